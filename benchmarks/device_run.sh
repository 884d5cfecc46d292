#!/bin/bash
# Runs GPU tests and benchmark tables on the lent device machine in one call, within its 10-minute limit.
#
#   (here)   echo /.whl/ >> .git/info/exclude; pip download ... -d .whl torchao==0.17.0 ml_collections==1.1.0 \
#                tensorboardX==2.6.5   (the device README's wheel command; the image lacks all three, and
#                train.py's rows and scaling.py fail at import without tensorboardX)
#   (device) QJAX_COMMIT=<local HEAD> bash benchmarks/device_run.sh tests-kernels quantize linear train
#            with carry [".whl"]
#
# Steps run in the order given, each under `timeout` with what is left of BUDGET seconds (default 570), so a slow
# step cannot take the whole call's output with it: every step's output goes to $OUT/device.log as it runs, and
# the lines the benchmarks appended to benchmarks/RESULTS.md come back as $OUT/results.diff (apply it here with
# `patch -p0 benchmarks/RESULTS.md < results.diff`). QJAX_COMMIT names the code in those RESULTS headings: the
# device copy's .git can be stale (benchmarks/NOTES.md, device-time lessons).
#
# Steps: tests-kernels (the GPU-relevant kernel tests, compiled), tests-optim (fused AdamW GPU tests, all run: no
# -x), sr-cost (benchmarks/sr_cost.py: what stochastic rounding costs the quantize kernel; sr-tests: the quantize
# kernel's and stochastic rounding's tests, compiled), quantize (kernels.py
# quantize), swiglu-tests / swiglu-kernels (the fused SwiGLU kernels' tests compiled; kernels.py swiglu), gemm
# (kernels.py gemm), matmul (A.B^T at 8192), linear (with the torch peer), train (the
# 1.1B table with the torch peer), train-qjax (the 1.1B table without the peer), train-sr (bf16, int8_rowwise and
# int8_rowwise with stochastic rounding of the gradients), hf (the Hugging Face Llama and generate tests, the
# transformers parity among them), hf-generate (benchmarks/generate.py: prefill and decode of the 1b preset, bf16 /
# int8 weight-only / fp8 rowwise, batch 1 and 8; hf-generate-int8: bf16 and int8_rowwise), hf-finetune
# (benchmarks/finetune.py: 300 int8_rowwise steps from
# a random HF checkpoint on a JSONL task), linear-ab (int8_rowwise and fp8_tensorwise at two shapes, no peer, not
# appended), optim-ab (the low-bit AdamW step rows against optax.adamw, float32 and bf16 + SR params),
# memory-8b (the 8b preset's train step, bf16 and int8_rowwise, bf16 params + SR + adamw_8bit, remat: peak memory,
# tokens/s, MFU beside the estimate; then the torch peer, HF LlamaForCausalLM + torchao AdamW8bit; every row capped
# at 80 GB as on an H100; memory-8b-peer: the torch row alone), train-row (the 1.1B
# int8_rowwise row, not appended), default-run (the GPU default of `make
# train` on the Shakespeare corpus: carry "data" prepared here), dataflow (the 1.1B rows of the data-flow recipes),
# dataflow-conv (benchmarks/convergence.py at the default run's 125M settings for bf16, the data-flow recipes and
# bitnet_b158: carry "data"; the new PNG comes back in $OUT), dataflow-conv-seed0 .. -seed3 (bf16 and the data-flow
# recipes, with int8_rowwise as the GEMM-only control, under one seed, not appended: one lane each) then
# dataflow-conv-seeds (reuses them: the table over seeds
# 0-3, mean ± s.e. of each seed's difference to bf16; run as a second device_run.sh after the lanes),
# dataflow-ablation-seed0 .. -seed3 / dataflow-ablation-seeds (the same for bf16, int8_dataflow_sr and
# int8_rowwise_sr: what Jetfire's stochastic rounding of the gradients costs), dataflow-sr (speed: bf16,
# int8_dataflow and int8_dataflow_sr),
# conv-seedN=RECIPE,RECIPE (those recipes, seed N, the same settings, nothing appended),
# tests-moe (the ragged_dot, MXFP8 and MoE tests on the
# GPU: XLA's grouped GEMMs on 8-bit operands), moe (benchmarks/ragged.py: MoE grouped GEMMs per recipe vs bf16 on
# JAX's grouped kernels), moe-kernels (the grouped kernels' GPU tests; run "moe-kernels moe"), moe-wg-tests / moe-wg
# (the grouped kernels with one and with two compute warpgroups: their tests compiled, then ragged.py's rows side by
# side; run "moe-wg-tests moe-wg"), moe-profile (ragged.py's rows, each with its device time by category and 25
# largest ops; not appended), moe-fp8-diag (the fp8
# contracting kernel against exact sums, per-tile diagnosis and XLA's fp8 reference error printed), moe-train /
# moe-train-fp8 (a 4-layer MoE Llama, 1.1B widths, 8 of 64 experts of FFN 1408 per token, end to end: bf16 against
# int8_rowwise / fp8_rowwise), linear-mxfp8
# (linear.py's fp8_blockwise and mxfp8 rows, no peer), tests-bitnet (bitnet_b158's
# kernels compiled), bitnet (linear int8_rowwise vs bitnet_b158, no peer), bitnet-train (the 1.1B bf16 /
# int8_rowwise / bitnet_b158 rows), int8-params (the 1.1B int8_rowwise rows with int8 weight-only and with bf16 + SR
# params: run it after bitnet-train, whose int8_rowwise row has float32 params), bitnet-conv (125M convergence, bf16
# vs bitnet_b158: carry "data"; bitnet-conv-lr after it adds bitnet_b158 at 2x bf16's LR, reusing its runs;
# bitnet-conv-2x: bf16 and bitnet_b158 at 2x bf16's LR alone),
# gpt2-conv (GPT-2 small, 600 steps of 32 x 1024 bytes, bf16 vs the data-flow recipes, Jetfire's setting: carry
# "data"; convergence_gpt2.png comes back in $OUT; gpt2-conv=R1,R2 runs those recipes alone, not appended, its PNG
# to $OUT/gpt2-conv-R1-R2.png, so lanes, each with its own recipes, share the runs and a gpt2-conv after them reuses
# them), fsdp1 (the 1.1B bf16 and int8_rowwise rows with the default mesh, fsdp=1 on one GPU: "fsdp1 fsdp1@base"
# is the before/after of the mesh code on one GPU), bitnet-fsdp (several GPUs: the 1B train step over fsdp=all,
# int8_rowwise vs bitnet_b158 with its ternary codes gathered packed 2 bits each vs the float weights gathered),
# bitnet-bf16-bwd (linear bitnet_b158 vs bitnet_b158_bf16_bwd, no peer).
# A step written STEP@base
# runs in .baseline, an exported tree of another commit (`git archive REV | tar -x -C .baseline`, carried): a
# before/after A/B in one call; STEP@NAME runs in .tree-NAME, exported and carried the same way (a third tree).
# On a machine with several GPUs, "A B -- C D" runs the lanes A B and C D at the same time, one GPU each.
# Steps: profile-int8-dataflow (benchmarks/profile_train.py of the 1.1B int8_dataflow row),
# dataflow-mem (bf16 and the 1.1B data-flow rows, int8_dataflow also with adamw_fp8 states: speed
# and peak memory against bf16), dataflow-b16 (batch 16 x 2048: bf16 against int8_dataflow with adamw_fp8 states;
# dataflow-b16-int8 the int8_dataflow row alone: bf16 runs out of memory at this batch on an H100),
# dataflow-ab (int8_rowwise against int8_dataflow: what the data flow costs), dataflow-recompute (int8_dataflow
# against int8_dataflow_recompute, the prologue outputs recomputed for wgrad: speed and peak memory),
# dataflow-mem-recompute (bf16 against int8_dataflow_recompute with optax and with adamw_fp8 states: issue 28's
# peak-memory targets, <= 0.70x / <= 0.60x of bf16), dataflow-mem-attn (bf16 and int8_dataflow_recompute, each
# also with config.model.recompute_attention: speed and peak), dataflow-mem-recompute-w (bf16,
# int8_dataflow_recompute and int8_dataflow_recompute_w, which also re-quantizes the weights' dgrad codes in the
# backward: speed and peak),
# dataflow-peer (bf16, int8_rowwise, int8_dataflow and the torch peer in one run), peak-memory
# (benchmarks/peak_memory.py: the 1.1B step of bf16 and the data-flow recipes compiled, not run: XLA's planned peak,
# and its memory-usage reports in $OUT/peak-memory), hlo-int8-rowwise / hlo-int8-dataflow (the profile's 150
# largest ops and the
# step's optimized HLO in $OUT, gzipped: which fusions the data-flow recipe adds), hf-vit (the Hugging Face ViT tests:
# load_hf_vit / save_hf_vit, transformers parity included).
# adam-sr-diag: bf16 params + SR in the fused AdamW kernel vs its reference, both sides' float32 intermediates
# where params differ and the PTX's float32 op counts (Mosaic GPU and XLA dumps); adam-sass: the fused AdamW
# kernels' SASS and PTX (8-bit and e4m3, bf16 + SR) in $OUT/sass, to count instructions per element here;
# optim-sr: the bf16 + SR AdamW step
# (8-bit and e4m3 states), streamed jnp against the fused kernel, each against optax.adamw (float32); optim-8bit:
# the 8-bit kernel rows alone, float32 and bf16 + SR params ("optim-8bit optim-8bit@base": an A/B); optim-4bit:
# the same for adamw_4bit with float32 params; optim-dre: the same for adamw_fp8 with range expansion (COAT), and
# optim-dre-sr with bf16 params + SR;
# tests-optim-dre: the fused AdamW GPU tests of range-expanded states alone, with their mismatch counts printed;
# dre-diag: the range expansion's k and centre compiled vs jnp, on the same blocks and in the step, both sides'
# values printed in float32 and hex with the blocks' max / min (test_gpu_dre_diagnosis).
# tests-rmsnorm: the fused RMSNorm kernel's tests, compiled; rmsnorm-kernels: kernels.py rmsnorm (its table).
# Several GPUs (nvidia-h100-x2 and up): tests-mesh-gpu (the mesh / FSDP tests on every GPU), tests-adam-mesh (the fused
# AdamW step per device against one GPU's, e4m3 / 8-bit / 4-bit), optim-mesh (benchmarks/optim_mesh.py: the bf16 + SR
# adamw_8bit step under FSDP over all GPUs, per-device kernel vs jnp vs optax.adamw, 4 Llama-3-8B layers),
# scaling-1b, scaling-1b-more, scaling-8b
# (benchmarks/scaling.py; scaling-8b-int8 its int8_rowwise row alone; scaling-8b-b8-bf16 / scaling-8b-b8-int8 one
# row at global batch 8 with GPU 0's profile, scaling-8b-b8-int8-bf16gather the int8 row gathering bf16 weights
# (issue 24's 8-bit against bf16 gather); scaling-8b-b16-bf16 / -int8 / -int8-bf16gather: the same rows at global
# batch 16; scaling-8b-b16-fp8 the fp8_tensorwise row, scaling-8b-b16-dataflow the int8_dataflow row),
# torch-fsdp (benchmarks/torch_fsdp_peer.py: torchrun, FSDP2, bf16 vs
# torchao float8; torch-fsdp-8b: the 8b preset's shape at global batch 8, the qjax 8B rows' peer).
set -o pipefail
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
OUT=${OUT:-/tmp/device_out}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
LOG=$OUT/device.log
cd "$(dirname "$0")/.."

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
[ -n "$QJAX_COMMIT" ] || echo "QJAX_COMMIT is not set: headings name the device copy's git" | tee -a "$LOG"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader 2>&1 | tee -a "$LOG"
cp benchmarks/RESULTS.md /tmp/RESULTS.before
for png in convergence convergence_bitnet convergence_gpt2; do cp benchmarks/$png.png /tmp/$png.before.png; done

step_command() {
    local kernel_rows="int8_row_kernel fp8_row_kernel int8_block_kernel fp8_block_kernel"
    case "$1" in
        tests-kernels) echo "python3 -m pytest -x -q -p no:cacheprovider tests/kernels" ;;
        tests-optim) echo "python3 -m pytest -q -p no:cacheprovider -m gpu tests/optim/test_fused_kernel.py" ;;
        sr-cost) echo "python3 benchmarks/sr_cost.py" ;;
        sr-tests) echo "python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_quantize_mgpu.py" \
                       "tests/test_stochastic.py tests/test_quantize.py" ;;
        adam-sr-diag) echo "env MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=/tmp XLA_FLAGS=--xla_dump_to=/tmp/adam_xla" \
                          "python3 -m pytest -q -s -p no:cacheprovider -m gpu -k diagnosis" \
                          "tests/optim/test_fused_kernel.py" ;;
        adam-sass) echo "env MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$OUT/sass" \
                        "python3 benchmarks/optim.py --rows 8bit_sr_kernel fp8_sr_kernel --rounds 1" ;;
        optim-sr) echo "python3 benchmarks/optim.py --rows 8bit_sr 8bit_sr_kernel fp8_sr fp8_sr_kernel --rounds 3" ;;
        optim-4bit) echo "python3 benchmarks/optim.py --rows 4bit 4bit_kernel --rounds 3" ;;
        optim-8bit) echo "python3 benchmarks/optim.py --rows 8bit_kernel 8bit_sr_kernel --rounds 3" ;;
        optim-dre) echo "python3 benchmarks/optim.py --rows fp8_dre fp8_dre_kernel --rounds 3" ;;
        optim-dre-sr) echo "python3 benchmarks/optim.py --rows fp8_dre_sr fp8_dre_sr_kernel --rounds 3" ;;
        tests-optim-dre) echo "python3 -m pytest -x -q -s -p no:cacheprovider -m gpu -k dre" \
                              "tests/optim/test_fused_kernel.py" ;;
        dre-diag) echo "python3 -m pytest -q -s -p no:cacheprovider -m gpu -k dre_diagnosis" \
                       "tests/optim/test_fused_kernel.py" ;;
        quantize) echo "python3 benchmarks/kernels.py quantize --shapes 16384x4096 16384x14336" ;;
        swiglu-tests) echo "python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_swiglu_mgpu.py" ;;
        swiglu-kernels) echo "python3 benchmarks/kernels.py swiglu --tiles 2048 4096 8192" ;;
        gemm) echo "python3 benchmarks/kernels.py gemm --sizes 4096 8192 --cases" \
                   "int8_block fp8_block fp8_tensor_precise" ;;
        matmul) echo "python3 benchmarks/matmul.py --layouts TN --sizes 8192 --rows bf16 int8 fp8 $kernel_rows" ;;
        tests-rmsnorm) echo "python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_rmsnorm_mgpu.py" ;;
        rmsnorm-kernels) echo "python3 benchmarks/kernels.py rmsnorm --shapes 16384x2048 16384x4096" \
                              "--rows-per-program 32 4" ;;
        linear) echo "python3 benchmarks/linear.py --shapes 4096x4096 4096x14336 --reps 10 --recipes" \
                     "int8_rowwise fp8_tensorwise fp8_rowwise fp8_blockwise" ;;
        train) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise --steps 5 --warmup 2" \
                    "--peer-variants bf16 float8_tensorwise" ;;
        train-qjax) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise fp8_tensorwise fp8_blockwise" \
                         "--steps 5 --warmup 2 --no-peer" ;;
        linear-ab) echo "python3 benchmarks/linear.py --shapes 4096x4096 4096x14336 --reps 10 --recipes" \
                        "int8_rowwise fp8_tensorwise --no-peer --no-append" ;;
        train-row) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise --steps 5 --warmup 2 --no-peer" \
                        "--no-append" ;;
        optim-ab) echo "python3 benchmarks/optim.py --rows 8bit 8bit_kernel fp8 fp8_kernel 8bit_sr 8bit_sr_kernel" \
                       "--rounds 3" ;;
        memory-8b) echo "python3 benchmarks/memory.py --rows 8b_bf16 8b_int8 8b_torch --steps 3 --warmup 1" \
                        "--memory-limit-gb 80" ;;
        memory-8b-peer) echo "python3 benchmarks/memory.py --rows 8b_torch --steps 3 --warmup 1 --memory-limit-gb 80" ;;
        default-run) echo "python3 train.py --config configs/llama_int8.py $(make -s train-args) --workdir" \
                          "/tmp/default_run" ;;
        tests-moe) echo "python3 -m pytest -x -q -p no:cacheprovider tests/test_ragged_dot.py tests/test_mxfp8.py" \
                        "tests/models/test_moe.py" ;;
        moe) echo "python3 benchmarks/ragged.py" ;;
        moe-train) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise --layers 4 --moe 64,8,0,1408 --steps 5" \
                        "--warmup 2 --no-peer" ;;
        moe-train-fp8) echo "python3 benchmarks/train.py --rows bf16 fp8_rowwise --layers 4 --moe 64,8,0,1408" \
                            "--steps 5 --warmup 2 --no-peer" ;;
        moe-kernels) echo "python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_grouped_matmul_mgpu.py" \
                          "tests/test_ragged_dot.py" ;;
        moe-wg-tests) t=tests/kernels/test_grouped_matmul_mgpu.py; echo "python3 -m pytest -q -p no:cacheprovider" \
                           "$t::test_kernel_at_size $t::test_contract_kernel_at_size $t::test_kernel_equals_reference" \
                           "$t::test_precise_fp8_promotes $t::test_contract_kernel_equals_reference" ;;
        moe-wg) echo "python3 benchmarks/ragged.py --warpgroups 2 1" ;;
        moe-profile) echo "python3 benchmarks/ragged.py --no-append --profile 25" ;;
        moe-fp8-diag) t=tests/kernels/test_grouped_matmul_mgpu.py; echo "python3 -m pytest -q -s -rxX -p" \
                           "no:cacheprovider $t::test_fp8_contract_kernel $t::test_contract_kernel_at_size" ;;
        linear-mxfp8) echo "python3 benchmarks/linear.py --shapes 4096x4096 4096x14336 --reps 10 --recipes" \
                           "fp8_blockwise mxfp8 --no-peer" ;;
        train-sr) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise int8_rowwise_sr --steps 5 --warmup 2" \
                       "--no-peer" ;;
        dataflow) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise int8_dataflow fp8_dataflow --steps 5" \
                       "--warmup 2 --no-peer" ;;
        dataflow-mem) echo "python3 benchmarks/train.py --rows bf16 int8_dataflow int8_dataflow+adamw_fp8" \
                           "fp8_dataflow --steps 5 --warmup 2 --no-peer" ;;
        dataflow-b16) echo "python3 benchmarks/train.py --rows bf16 int8_dataflow+adamw_fp8 --batch 16 --steps 5" \
                           "--warmup 2 --no-peer" ;;
        dataflow-b16-int8) echo "python3 benchmarks/train.py --rows int8_dataflow+adamw_fp8 --batch 16 --steps 5" \
                                "--warmup 2 --no-peer" ;;
        dataflow-sr) echo "python3 benchmarks/train.py --rows bf16 int8_dataflow int8_dataflow_sr --steps 5" \
                          "--warmup 2 --no-peer" ;;
        dataflow-ab) echo "python3 benchmarks/train.py --rows int8_rowwise int8_dataflow --steps 5 --warmup 2" \
                           "--no-peer" ;;
        dataflow-recompute) echo "python3 benchmarks/train.py --rows int8_dataflow int8_dataflow_recompute --steps 5" \
                                 "--warmup 2 --no-peer" ;;
        dataflow-mem-recompute) echo "python3 benchmarks/train.py --rows bf16 int8_dataflow_recompute" \
                                     "int8_dataflow_recompute+adamw_fp8 --steps 5 --warmup 2 --no-peer" ;;
        dataflow-mem-attn) echo "python3 benchmarks/train.py --rows bf16 bf16:recompute_attention" \
                                "int8_dataflow_recompute int8_dataflow_recompute:recompute_attention" \
                                "--steps 5 --warmup 2 --no-peer" ;;
        dataflow-mem-recompute-w) echo "python3 benchmarks/train.py --rows bf16 int8_dataflow_recompute" \
                                       "int8_dataflow_recompute_w --steps 5 --warmup 2 --no-peer" ;;
        dataflow-peer) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise int8_dataflow --steps 5 --warmup 2" ;;
        peak-memory) echo "python3 benchmarks/peak_memory.py --layers 22 --recipes bf16 int8_dataflow fp8_dataflow" \
                          "--memory-report $OUT/peak-memory" ;;
        profile-int8-dataflow) echo "python3 benchmarks/profile_train.py --row int8_dataflow --top 40" ;;
        hlo-int8-rowwise|hlo-int8-dataflow)
            echo "python3 benchmarks/profile_train.py --row $(echo ${1#hlo-} | tr - _) --top 150" \
                 "--dump-hlo $OUT/${1#hlo-}.hlo" ;;
        dataflow-conv) echo "python3 benchmarks/convergence.py --recipes bf16 fp8_dataflow int8_dataflow" \
                            "bitnet_b158 --size 125m" \
                            "--seq-len 1024 --batch-size 32 --steps 750 --lr 6e-4 --workdir /tmp/convergence" ;;
        dataflow-conv-seed[0-9]|dataflow-conv-seeds|dataflow-ablation-seed[0-9]|dataflow-ablation-seeds)
            # one seed per lane, then the table over seeds 0-3
            seeds=${1##*-seed}; [ "$seeds" = s ] && seeds="0 1 2 3"
            recipes="bf16 int8_dataflow fp8_dataflow int8_rowwise"
            [[ $1 == dataflow-ablation-* ]] && recipes="bf16 int8_dataflow_sr int8_rowwise_sr"
            echo "python3 benchmarks/convergence.py --recipes $recipes" \
                 "--size 125m" \
                 "--seq-len 1024 --batch-size 32 --steps 750 --lr 6e-4 --workdir /tmp/convergence --seeds $seeds" \
                 "$([ "${#seeds}" = 1 ] && echo --no-append --png /tmp/convergence_seed$seeds.png)" ;;
        conv-seed[0-9]=*)  # conv-seedN=RECIPE,RECIPE...: those recipes at the default run's 125M settings, one seed
            echo "python3 benchmarks/convergence.py --recipes ${1#*=} --size 125m --seq-len 1024 --batch-size 32" \
                 "--steps 750 --lr 6e-4 --workdir /tmp/convergence --seeds ${1:9:1} --no-append" \
                 "--png $OUT/conv-seed${1:9:1}.png" | tr , ' ' ;;
        tests-bitnet) echo "python3 -m pytest -x -q -p no:cacheprovider -m gpu tests/test_bitnet.py" ;;
        bitnet) echo "python3 benchmarks/linear.py --shapes 4096x4096 4096x14336 --reps 10 --recipes" \
                     "int8_rowwise bitnet_b158 --no-peer" ;;
        bitnet-train) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise bitnet_b158 --steps 5 --warmup 2" \
                           "--no-peer" ;;
        int8-params) echo "python3 benchmarks/train.py --rows int8_rowwise_int8_params int8_rowwise_bf16_params_sr" \
                          "--steps 5 --warmup 2 --no-peer" ;;
        bitnet-conv) echo "python3 benchmarks/convergence.py --size 125m --seq-len 1024 --batch-size 32 --steps 750" \
                          "--lr 6e-4 --recipes bf16 bitnet_b158 --workdir /tmp/convergence" \
                          "--png benchmarks/convergence_bitnet.png" ;;
        bitnet-conv-lr) echo "python3 benchmarks/convergence.py --size 125m --seq-len 1024 --batch-size 32" \
                             "--steps 750 --lr 6e-4 --recipes bf16 bitnet_b158 bitnet_b158@1.2e-3" \
                             "--workdir /tmp/convergence --png benchmarks/convergence_bitnet.png" ;;
        bitnet-conv-2x) echo "python3 benchmarks/convergence.py --size 125m --seq-len 1024 --batch-size 32" \
                             "--steps 750 --lr 6e-4 --recipes bf16 bitnet_b158@1.2e-3" \
                             "--workdir /tmp/convergence --png benchmarks/convergence_bitnet.png" ;;
        hf) echo "python3 -m pytest -x -q -p no:cacheprovider tests/models/test_hf_llama.py" \
                 "tests/models/test_generate.py" ;;
        hf-vit) echo "python3 -m pytest -x -q -p no:cacheprovider tests/models/test_hf_vit.py" ;;
        hf-generate) echo "python3 benchmarks/generate.py" ;;
        hf-generate-int8) echo "python3 benchmarks/generate.py --rows bf16 int8_rowwise" ;;
        hf-finetune) echo "python3 benchmarks/finetune.py --steps 300" ;;
        gpt2-conv|gpt2-conv=*)  # gpt2-conv=R1,R2: those recipes alone, not appended (one lane each, then gpt2-conv)
            recipes="bf16 int8_dataflow int8_dataflow_sr fp8_dataflow" append=""
            [[ $1 == *=* ]] && recipes=$(echo "${1#*=}" | tr , ' ') \
                append="--no-append --png $OUT/gpt2-conv-$(echo "${1#*=}" | tr , -).png"
            echo "python3 benchmarks/convergence.py --model gpt2 --size gpt2 --recipes $recipes" \
                 "--seq-len 1024 --batch-size 32 --steps 600 --lr 6e-4 --workdir /tmp/convergence $append" ;;
        fsdp1) echo "python3 benchmarks/train.py --rows bf16 int8_rowwise --steps 5 --warmup 2 --no-peer" ;;
        tests-mesh-gpu) echo "env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider -m gpu" \
                             "tests/test_mesh_gpu.py" ;;
        tests-adam-mesh) echo "python3 -m pytest -q -p no:cacheprovider -m gpu tests/optim/test_fused_mesh.py" ;;
        optim-mesh) echo "python3 benchmarks/optim_mesh.py --layers 4" ;;
        scaling-1b) echo "python3 benchmarks/scaling.py --size 1b --rows bf16 int8_rowwise int8_rowwise:bf16" \
                         "--baselines bf16 int8_rowwise --steps 3 --warmup 1" ;;
        scaling-1b-more) echo "python3 benchmarks/scaling.py --size 1b --rows fp8_tensorwise int8_dataflow" \
                              "--steps 3 --warmup 1" ;;
        scaling-8b) echo "python3 benchmarks/scaling.py --size 8b --batch 4 --remat --param-dtype bfloat16 --sr" \
                         "--optimizer adamw_8bit --rows bf16 int8_rowwise --baselines int8_rowwise --steps 3" \
                         "--warmup 1" ;;
        scaling-8b-int8) echo "python3 benchmarks/scaling.py --size 8b --batch 4 --remat --param-dtype bfloat16 --sr" \
                              "--optimizer adamw_8bit --rows int8_rowwise --steps 3 --warmup 1" ;;
        scaling-8b-b8-bf16|scaling-8b-b8-int8|scaling-8b-b8-int8-bf16gather|scaling-8b-b16-bf16|\
        scaling-8b-b16-int8|scaling-8b-b16-int8-bf16gather|scaling-8b-b16-fp8|scaling-8b-b16-dataflow)  # 2-5 min each
            batch=${1#scaling-8b-b}; batch=${batch%%-*}
            case "$1" in
                *-bf16) row=bf16 ;; *-int8) row=int8_rowwise ;; *-int8-bf16gather) row=int8_rowwise:bf16 ;;
                *-fp8) row=fp8_tensorwise ;; *-dataflow) row=int8_dataflow ;;
            esac
            profile=""; [ "$batch" = 8 ] && profile="--profile 40"  # GPU 0's profile at batch 8 only (b16: time)
            echo "python3 benchmarks/scaling.py --size 8b --batch $batch --remat --param-dtype bfloat16 --sr" \
                 "--optimizer adamw_8bit --rows $row --steps 3 --warmup 1 $profile" ;;
        torch-fsdp) echo "python3 benchmarks/torch_fsdp_peer.py" ;;
        torch-fsdp-8b) echo "python3 benchmarks/torch_fsdp_peer.py --dim 4096 --layers 32 --heads 32 --kv-heads 8" \
                            "--ffn 14336 --vocab 128256 --batch 8 --steps 3 --warmup 1 --timeout 420" ;;
        bitnet-fsdp) echo "python3 benchmarks/scaling.py --size 1b --rows int8_rowwise bitnet_b158 bitnet_b158:bf16" \
                          "--steps 3 --warmup 1" ;;
        bitnet-bf16-bwd) echo "python3 benchmarks/linear.py --shapes 4096x4096 4096x14336 --reps 10 --recipes" \
                              "bitnet_b158 bitnet_b158_bf16_bwd --no-peer" ;;
        *) return 1 ;;
    esac
}

run_steps() {  # run_steps LOG STEP...: the steps in order, each timed out at what is left of BUDGET
    local log=$1 step tree command left
    shift
    for step in "$@"; do
        tree=$PWD
        if [[ $step == *@* ]]; then  # STEP@base: .baseline; STEP@NAME: .tree-NAME
            tree=$PWD/.baseline
            [ "${step#*@}" = base ] || tree=$PWD/.tree-${step#*@}
            step=${step%@*}
        fi
        command=$(step_command "$step") || { echo "unknown step '$step'" | tee -a "$log"; return 2; }
        left=$((BUDGET - SECONDS))
        if [ "$left" -lt 30 ]; then
            echo "== $step: skipped, ${left} s of the budget left" | tee -a "$log"
            continue
        fi
        if [ ! -d "$tree" ]; then
            echo "== $step: no tree $tree (export it and carry it)" | tee -a "$log"
            continue
        fi
        echo "== $step in $tree ($left s left): $command" | tee -a "$log"
        # PYTHONPATH names this checkout: point it at the step's tree before the cd changes $PWD
        (export PYTHONPATH="${PYTHONPATH/"$PWD"/$tree}"; cd "$tree" && timeout "$left" $command) 2>&1 | tee -a "$log"
        echo "== $step: exit ${PIPESTATUS[0]} at $SECONDS s" | tee -a "$log"
    done
}

# "--" between steps splits them into lanes that run at the same time, lane i on GPU i alone
# (CUDA_VISIBLE_DEVICES=i): one-GPU steps of a multi-GPU machine side by side. Each lane logs to $OUT/lane<i>.log.
lanes=() lane=""
for arg in "$@"; do
    if [ "$arg" = "--" ]; then lanes+=("$lane"); lane=""; else lane="$lane $arg"; fi
done
lanes+=("$lane")
if [ ${#lanes[@]} -eq 1 ]; then
    run_steps "$LOG" "$@" || exit $?
else
    for i in "${!lanes[@]}"; do
        # shellcheck disable=SC2086  # a lane is a space-separated list of step names
        CUDA_VISIBLE_DEVICES=$i run_steps "$OUT/lane$i.log" ${lanes[$i]} &
    done
    wait
fi
[ -f /tmp/default_run/metrics.jsonl ] && cp /tmp/default_run/metrics.jsonl "$OUT/default_run_metrics.jsonl"
for hlo in "$OUT"/*.hlo; do [ -f "$hlo" ] && gzip -f "$hlo"; done
diff /tmp/RESULTS.before benchmarks/RESULTS.md > "$OUT/results.diff"
for png in convergence convergence_bitnet convergence_gpt2; do  # only the PNGs a step redrew come back
    cmp -s /tmp/$png.before.png benchmarks/$png.png || cp benchmarks/$png.png "$OUT/"
done
exit 0
