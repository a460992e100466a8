#!/usr/bin/env bash
# Issue 19's measurements on a 4-GPU machine (nvidia-h200-x4), in stages, after scripts/device.sh has
# built build-dev:
#   bash scripts/device.sh --bench 'bash scripts/receipts_w4.sh transport nodes layer skew'
# Stages (each command's full output in $R/NAME.log, its summary lines in $OUT/receipts_w4.txt; every
# JSON receipt and log in one archive, $OUT/receipts_w4.tgz, since the device tool returns 8 files):
#   transport  rdep bench dispatch (rdep vs NCCL all-to-allv in the same call): Moonlight at W = 2, 4,
#              DeepSeek-V3 at W = 4, uniform; Moonlight W = 4 at Zipf alpha 0.5, 1, 1.5, 2
#   nodes      the two-phase exchange with two GPU groups as two "nodes" (W = 4, N = 2): rdep check
#              --nodes, bench dispatch --nodes over NCCL's NVLink transport and over its network
#              (socket) transport, traffic against rdep model's prediction
#   layer      rdep bench layer (CUTLASS expert compute) beside the PyTorch EP baseline (torchrun) at
#              W = 2 and 4, Moonlight shape, uniform
#   skew       W = 4, Zipf alpha 0.5, 1, 1.5, 2: balancing off and ultraep, beside the baseline
#   reduce     LayerConfig::owner_reduce: rdep check --backend cuda --owner-reduce (W = 4, with and without
#              balancing), then rdep bench layer at W = 4 with and without --owner-reduce, alternated
#   scatter    the dispatch scatter's two shapes (RDEP_SCATTER=pair, the default: a warp per (token, owner);
#              token: a warp per token): rdep check --backend cuda with token, then bench dispatch alternated
#   sms        LayerConfig::transport_sms: rdep check with a budget, bench dispatch at W = 4 over budgets
#              8 ... 132 SMs and unbudgeted, bench layer W = 4 with 32 SMs beside unbudgeted
#   memory     rdep bench layer at W = 4 with capacity factors 1.0 and 1.25 (the owner's row buffers bounded by
#              MaxSegmentRows), and --layers 4 and 8 (per-rank memory of a stack of layers on one domain), with
#              and without --owner-reduce
#   dsv3       the layer at the DeepSeek-V3 shape (H 7168, D_ff 2048, E 256, K 8), W = 4, with baseline
#   combine    the per-slot return's row order (RDEP_RETURN_ORDER=grouped against the default spread,
#              alternated) at W = 4, uniform and Zipf 1, 2; bench dispatch --owner-reduce (one reduced row per
#              (token, owner) crosses back) at W = 2, 4, Zipf 1 and DeepSeek-V3, beside NCCL
#   overlap    the overlapped segment pipeline (--overlap): rdep check against the host reference at W = OV_W
#              (default 4) on OV_W GPUs and with 4 ranks sharing GPU 0, then the Moonlight layer at W = OV_W in one
#              segment, in 2 and 4 segments in sequence and overlapped, the expert GEMMs leaving 0, 16 or 32 SMs
#   rows       the owner's rows in one set (seventh session): the layer at W = 4 beside the baseline (fp32 and
#              --grads bf16), the pipeline with 2 and 4 segments, the cuBLASLt and balanced layers (two sets), then
#              stage one (W = 1 on GPU 0)
#   windows    per-source windows (LayerConfig::source_windows, the default) against the three phases
#              (--no-source-windows) at W = WIN_W (default 4) on WIN_W GPUs: rdep check, then bench dispatch at the
#              Moonlight shape (uniform and Zipf 1) and DeepSeek-V3's, alternated a/b, and the layer beside the baseline
#   pdl        programmatic dependent launch (RDEP_PDL=on, the default) against plain launches (off), alternated:
#              bench dispatch at W = PDL_W (default 2) and 1, the W = 1 layer, DeepSeek-V3's dispatch; RDEP_PDL=yes refused
#   pair       what a 2-GPU machine (nvidia-h200-x2) can show: bench dispatch at W = 2 (Moonlight uniform and Zipf 1,
#              DeepSeek-V3), the layer at W = 2 beside the baseline, with and without --owner-reduce
#   pairskew   the layer at W = 2 under Zipf alpha 1 and 2, balancing off and ultraep (2-GPU machine)
#   gate2      the layer at W = GATE_W (default 2) under Zipf alpha 1 and 2: balancing off, ultraep, and ultraep
#              with the gain gate (--min-gain 2500); gate4 is the same at W = 4
#   binding2   graph1 at W = 2 on a 2-GPU machine: bench/torch_layer_bench.py under torchrun --nproc-per-node=2 beside
#              rdep bench layer --ranks 2 --gpus 2 on the same routing, 256 and 4096 tokens a rank, eager and captured
#   binding1   what rdep.torch adds to the layer (bench/torch_layer_bench.py beside rdep bench layer --ranks 1
#              --grads bf16, CUTLASS compute, alternated a/b) on one GPU
#   stack2     per-rank memory of stacks of 4 and 8 Moonlight layers at W = 2 (CUTLASS compute)
#   train2     examples/torch_training under torchrun --nproc-per-node=2 (eager), rdep's MoE beside TorchTitan's
#   train      examples/torch_training under torchrun --nproc-per-node=4, rdep's MoE beside TorchTitan's
#              (eager and --compile); needs the wheels in .whl/ (torchtitan and its dependencies)
# Stages for one GPU (issues 14 and 15 on nvidia-h200; the archive keeps its name):
#   one        the layer at W = 1 (Moonlight, CUTLASS compute, --graph) beside the baseline: fp32 weight
#              gradients (the layer's own weights) and --grads bf16 (bound bf16 weights and gradients, as
#              rdep.torch's), with the caller's tensors in the memory line
#   train1     examples/torch_training on one GPU (eager), rdep's MoE beside TorchTitan's
#   train1c    the same, both models compiled (--compile)
#   train1cg   train1c with rdep's MoE given --gate-in-expert on (the gate before W2), and the phase peaks at step 30
#   gemm1      rdep bench gemm (cutlass, cuBLASLt; fp32 and bf16 weight gradients) beside torch._grouped_mm on the
#              same counts (bf16 gradients), E_loc = 16
#   stash      the paged stash (--stash-rows): its cost at W = 1 (the layer with and without, alternating), and
#              a stack of 4 Moonlight layers' memory per rank at W = 4 ranks sharing GPU 0, without and with a
#              pool for the 4 layers' rows (4 x 26,624)
#   tiles1     each CUTLASS GEMM of the expert MLP alone per tile configuration (bench/lab/grouped_gemm_tiles)
#   rows2      the same at W = 2 over NVLink (2-GPU machine): the layer beside the baseline (fp32, --grads bf16), the
#              pipeline with 2 segments, the cuBLASLt layer
#   checks     rdep check --backend cuda, CUTLASS and cuBLASLt compute: W = 1, 4 ranks sharing GPU 0, W = every GPU;
#              the paged stash at W = every GPU; balanced at 4 ranks sharing GPU 0
#   gate       LayerConfig::gate_in_expert (the gate before W2): rdep check with it (W = 1, 4 ranks sharing GPU 0 with drops,
#              the pipeline and the stash, W = every GPU), then the Moonlight layer with and without it, alternated, at
#              W = 1 and W = every GPU, beside the baseline (fp32 and --grads bf16)
#   gather1    the owner's scaled gather with 16-byte accesses: the W = 1 layer (CUTLASS and cuBLASLt) against the rdep of
#              BASE_REV (default 8baccfd, built beside by scripts/build_rev.sh), alternated; then with --gate-in-expert
#   gate1r     gate_in_expert with owner_reduce on one GPU: rdep check with 4 ranks sharing GPU 0 (drops; segments and the
#              stash), the layer's memory per rank at W = 4 sharing with and without the gate, W = 1 times alternated
#   rows1      stage one, then the layer's memory per rank at W = 4 ranks sharing GPU 0 (one segment, --grads bf16,
#              the pipeline with 2 and 4 segments)
#   stack1     per-rank memory of a stack of 4 Moonlight layers at W = 1 (CUTLASS compute, --layers 4)
#   inplace1   the W = 1 combine reading the owner's rows in place (RDEP_W1_RETURN=in-place, the default) against
#              their copy into the return region (copy), alternated a/b: the Moonlight layer (CUTLASS with fp32 and
#              bf16 weight gradients, cuBLASLt), bench dispatch at W = 1; rdep check at W = 1 both ways
#   peak1      the training example (compiled, both variants, 40 steps): torch's allocations live at step 30's peak
#              (scripts/snapshot_peak.py on each variant's snapshot)
#   swiglu1    ncu's speed-of-light and memory sections for the SwiGLU kernels of the W = 1 layer, with and without the gate
#   mem1       the layer's memory per rank (one payload buffer when S >= W*T): Moonlight W = 1 with the gate, 4 ranks
#              sharing GPU 0 with the gate and owner_reduce (the eighth session's 3.602 and 2.523 GiB before)
#   host1      the binding's host time per call (bench/torch_layer_bench.py) at 256 tokens, where the GPU's work is
#              small, then under torch.profiler (host time by operation); then at the training example's shape (4096 tokens, H 1024)
#   seg1       the sync-free layer in several segments: rdep check --expert-compute cutlass --segment at W = 4
#              sharing the GPU, then the W = 1 Moonlight layer at --segment 1024 (4 segments) with the CUTLASS
#              compute (eager and graph replays) and with cuBLASLt (a host wait per segment), beside the baseline
#   prof1      the training example (compiled, both variants, 40 steps) under torch.profiler for steps 25-27: each
#              variant's device time per step (the profile's self CUDA total) beside its step time
#   trainpaire trainpair without torch.compile: each model eagerly, in a process of its own (rdep's MoE blocks through
#              rdep.torch's eager C++ path)
#   trainro    the training example with --compile-mode reduce-overhead (CUDA graphs; rdep's ops recorded in them
#              where its layers are capturable, the default), both variants, 200 steps, steps 100-102 under
#              torch.profiler; rdep with the default --expert-compute auto
#   trainrop   trainro with --capturable-ops off (rdep's plain ops, run between the captured partitions): the A/B
#   trainrok   trainro with --keep-weight-casts (all: rdep's forward casts saved for its backward, as TorchTitan's are)
#              (the training stages run rdep with the example's defaults: --keep-weight-casts after-first since the
#              fifteenth session, none before; trainsep names each setting)
#   trainroik  trainrok with --interleave
#   graph1     bench/torch_layer_bench.py --graph --kernels 20 (the binding's forward and forward+backward captured in CUDA graphs, and its kernels)
#              beside rdep bench layer --graph on the same routing (--routing-out / --routing-from), W = 1, the example's
#              layer shape at 256 and 4096 tokens
#   native1    where the binding's eager host time goes: bench/torch_layer_bench.py --timeline (the backward's thread
#              handoffs) and --native-profile (py-spy --native; carry .whl/ with the py_spy wheel) at the example's layer
#              shape, 256 and 4096 tokens
#   eager1     rdep.torch's eager C++ path against its Python path (torch_layer_bench.py --eager-ab 4 --stack 3
#              --timeline 200) beside the C++ layer, 4096 and 256 tokens
#   eager2     the eager C++ path's stack of 3 beside rdep bench layer --layers 3 (the C++ layer's own stack), and
#              py-spy --native samples of its calls (where its host time goes)
#   tstack1    a model's eager use of the binding: bench/torch_layer_bench.py --stack 3 (three layers chained, one backward
#              through all) and --timeline beside rdep bench layer's forward+backward on the same routing, W = 1, the
#              example's layer shape at 4096 and 256 tokens
#   trainsep   reduce-overhead with each model in a process of its own: TorchTitan's, rdep --keep-weight-casts (all),
#              rdep --keep-weight-casts after-first (the default), rdep --keep-weight-casts none
#   trainpair  trainsep's TorchTitan run and rdep with the example's defaults (--keep-weight-casts after-first) only
#   trainprof  trainpair's two runs for 104 steps with steps 100-102 under torch.profiler: each Chrome trace's kernels
#              per step, full names, and one step's kernels in order (bench/trace_kernels.py; the traces stay in
#              /tmp/rdep_traces on the device, not in the archive)
#   wgrad1     the weight-gradient GEMMs with beta 0 (as training) at E_loc 64, 8 and 1 (same tiles and bytes), ncu on
#              dW1, the example's MLP with pingpong tiles against the defaults (--targets "rdep grouped_gemm_tiles")
#   ncuwg      ncu on dW1 (beta 0) at E_loc 64 and in one group of the same tiles and bytes (wgrad1 runs it too)
#   trainovor  rdep with --timing overlapped, then with --owner-reduce too
#   tilesex    tiles1 at the training example's shape (E_loc 64, H 1024, F 704; mu 96, 384, 1536): the weight-gradient
#              GEMMs' tiles (build the grouped_gemm_tiles target)
#   trainov    trainpair's two runs with --timing synced (each step between two device synchronizations), then with
#              --timing overlapped (a step launched before the last is read back, timed between CUDA events)
#   trainbwac  the compiled backward's autocast: trainov's synced pair with --compiled-backward-autocast off (the example's
#              default) and same_as_forward (torch's), the overlapped pair (off), both models' profiles (off)
#   trainrep   trainpair's two runs twice, alternated (the spread of the tokens/s ratio between runs of one call)
#   trainwarm  rdep's first step (compile included), 30 steps under reduce-overhead: on an empty inductor cache, then
#              warm, then warm with --autograd-cache-functions off (AOTAutograd's cache bypassing the router's autograd
#              function, torch's default), then warm again with it on
#   trainprofor trainprof's rdep run with --owner-reduce
#   trainpairgaor trainpairga's two runs with rdep --owner-reduce between them
#   trainor    trainpair, then rdep with --owner-reduce (a token's rows summed by the owner before they return)
#   (Since the thirty-third session the example's rdep runs bf16 expert weights with MasterAdamW by default on CUDA
#   (--expert-weights auto), and since the thirty-fourth also with --grad-accum (trainpairga: the micro-batches' expert
#   gradients summed in fp32): the train* stages below compare with earlier receipts only with --expert-weights fp32.)
#   trainmw    trainpair, then rdep with --expert-weights bf16-master (bf16 expert weights and gradients, fp32 master
#              weights in rdep.torch.MasterAdamW)
#   trainmwtt  TorchTitan's MoE with --baseline-expert-weights bf16-master, then rdep with bf16-master: the same optimizer
#              and precision on both sides
#   optimmw    bench/optim_step.py: MasterAdamW's step against torch's fused AdamW on the example's expert weights
#   trainprofmw trainprof's rdep run with --expert-weights bf16-master
#   trainmwga  rdep with --grad-accum 4, GA_STEPS steps (default 100): --expert-weights fp32, then bf16-master (the
#              micro-batches' expert gradients summed in fp32 by MasterAdamW(fp32_grads=True))
#   trainip    trainpair, then rdep once more with RDEP_W1_RETURN=copy (the W = 1 return's copy, for the in-place combine's A/B)
#   trainpairga trainpair with --grad-accum 4 (four micro-batches of 4,096 tokens a step, the optimizer once a step, as
#              training with a large global batch runs it), GA_STEPS steps (default 100), each model in its own
#              process (examples/torch_training/compare_receipts.py compares the two receipts)
#   train2sep  trainsep's protocol at W = 2 under torchrun --nproc-per-node=2 (2-GPU machine): TorchTitan's MoE, rdep (its
#              capturable ops recorded in the graphs, one rank a process), rdep --capturable-ops off
#              (train2rdep, train2rdepp: its two rdep runs alone; TorchTitan's all-to-all has a new shape each step,
#              so reduce-overhead records graph after graph for it: train2c is its fair comparison)
#   train2c    both models under torchrun --nproc-per-node=2 with torch.compile's default mode, each in processes of its own
#   train2pair TorchTitan's MoE compiled (default mode) and rdep under reduce-overhead, each in its best mode, W = 2
#   trainroi   trainro with --interleave (both models resident, stepped in turn; memory not measured)
#   trainb32   the training example compiled at --batch 32 (16,384 tokens a step, 4x the default), both variants, 60 steps
#   epi1       GEMM1's SwiGLU epilogue (W1 interleaved8): rdep bench gemm, the pass and the epilogue on the default tile and
#              on ping_128x128, two rounds, beside torch._grouped_mm on the same counts; then ncu on the fused and unfused
#              GEMM1 at mu = 1536 (speed of light, scheduler, warp state and source counters: the top stall lines)
#   graph4     rdep bench layer --graph with several ranks (one graph of every rank's work): W = 4 sharing GPU 0 and, where
#              there are several GPUs, two ranks per GPU and one rank per GPU; Moonlight shape and the example's layer shape
#   host2      the binding's host time split into the C library's calls, the row allocator's calls into torch and
#              Python (bench/torch_layer_bench.py --host-breakdown), eager and through torch.compile, at 256 tokens and at
#              the training example's shape, with cProfile at the latter
#   host3      the C++ layer's host time per call (rdep bench layer --ranks 1, CUTLASS, gate in the expert, bf16 gradients)
#              beside the binding's (bench/torch_layer_bench.py) at 256 tokens and at the training example's shape
#   gaps1      where the training step's GPU waits for its host: the example under --compile-mode reduce-overhead (200
#              steps, steps 100-102 traced) and default compile (60 steps, 40-42 traced), both variants, each trace's idle
#              gaps charged to the host op that launched the work after them (scripts/trace_gaps.py); traces kept in /tmp
#   gemmex1    the training example's expert GEMMs (E_loc 64, H 1024, F 704, bf16 gradients; mu 96, 384 = its 4,096 tokens
#              top-6, 1536): rdep bench gemm over cuBLASLt, the default CUTLASS tiles and every tile (cutlass:all), beside
#              torch._grouped_mm (TorchTitan's) on the same counts
#   clocks1    rdep bench gemm (the default CUTLASS path, mu = 1536 and 3072) while nvidia-smi dmon samples the SM
#              clock, the power and the temperature every second, and nvidia-smi -q reads the clock-event reasons mid-run
# The baseline must travel: copy ../shared/baselines into ./shared/baselines (ignored), carry `shared`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
R=/tmp/receipts_w4
# The first run in a device call (no archive in $OUT yet) starts from an empty folder: a machine may keep /tmp from an
# earlier call, whose files the archive would otherwise carry; later runs in the same call add to it.
[ -f "$OUT/receipts_w4.tgz" ] || rm -rf "$R"
mkdir -p "$R" "$OUT"
LOG=$OUT/receipts_w4.txt
touch "$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
BASE=shared/baselines/torch_ep_moe.py
RDEP=build-dev/bin/rdep
# The train*, optim* stages need only the library (build-dev/lib/librdep_capi.so); the others the rdep command.
need_rdep=0
for st in "$@"; do case "$st" in train*|optim*) ;; *) need_rdep=1 ;; esac; done
[ $# -eq 0 ] && need_rdep=1
[ -x "$RDEP" ] || [ "$need_rdep" = 0 ] || { echo "receipts_w4: $RDEP missing (run through scripts/device.sh)" | tee -a "$LOG"; exit 2; }
fails=0
run() {  # run NAME CMD...: full output to $R/NAME.log, the command and its summary lines to $LOG
  local name=$1; shift
  echo "\$ $*" >>"$LOG"
  local t0=$SECONDS
  "$@" >"$R/$name.log" 2>&1
  local rc=$?
  { grep -E "^  (forward|backward|host time|load:|segments:|graph |memory|rdep dispatch|rdep combine|rdep phases|routing in parts|return in parts|nccl |balance|replica|breakdown|transport SMs|stack of|stack[0-9]|per layer|host timeline)|^    (forward|backward|per rank|one pass|handoff|formula) |passed, |baseline|speedup|traffic|^  [a-z -]+: +[0-9.]+ / |tokens/s|loss" "$R/$name.log" | head -40 ||
      tail -n 6 "$R/$name.log"; } >>"$LOG"
  echo "[$name rc=$rc, $((SECONDS - t0)) s]" >>"$LOG"
  [ $rc -eq 0 ] || fails=$((fails + 1))
  tar czf "$OUT/receipts_w4.tgz" -C "$R" .  # after every command: a timeout still returns what ran
}
layer() {  # layer TAG W ZIPF [rdep flags...]: the baseline, then rdep beside it
  local tag=$1 w=$2 zipf=$3; shift 3
  run torch_$tag torchrun --nproc-per-node="$w" "$BASE" --zipf "$zipf" --json "$R/torch_$tag.json"
  run layer_$tag "$RDEP" bench layer --ranks "$w" --expert-compute cutlass "$@" --json "$R/layer_$tag.json" --baseline-json "$R/torch_$tag.json"
}
stage_transport() {
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  run dispatch_moonlight_w2 "$RDEP" bench dispatch --ranks 2 "${moon[@]}" --json "$R/dispatch_moonlight_w2.json"
  run dispatch_moonlight_w4 "$RDEP" bench dispatch --ranks 4 "${moon[@]}" --json "$R/dispatch_moonlight_w4.json"
  run dispatch_dsv3_w4 "$RDEP" bench dispatch --ranks 4 --tokens 4096 --hidden 7168 --experts 256 --topk 8 --warmup 20 --iters 100 --json "$R/dispatch_dsv3_w4.json"
  for a in 0.5 1 1.5 2; do
    run dispatch_zipf${a}_w4 "$RDEP" bench dispatch --ranks 4 "${moon[@]}" --routing "zipf:$a" --json "$R/dispatch_zipf${a}_w4.json"
  done
}
stage_nodes() {
  run check_nodes_w4 "$RDEP" check --backend cuda --ranks 4 --gpus 4 --nodes 2 --max-nodes 2 --routing zipf:1 --json "$R/check_nodes_w4.json"
  run check_nodes_w4_m1 "$RDEP" check --backend cuda --ranks 4 --gpus 4 --nodes 2 --max-nodes 1 --capacity-factor 1.0 --json "$R/check_nodes_w4_m1.json"
  run dispatch_nodes_w4_nvlink "$RDEP" bench dispatch --backend cuda --ranks 4 --gpus 4 --nodes 2 --iters 100 --json "$R/dispatch_nodes_w4_nvlink.json"
  run dispatch_nodes_w4_net env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
    "$RDEP" bench dispatch --backend cuda --ranks 4 --gpus 4 --nodes 2 --iters 50 --json "$R/dispatch_nodes_w4_net.json"
}
stage_layer() {
  layer w2 2 0
  layer w4 4 0
}
stage_skew() {
  for a in 1 2 0.5 1.5; do
    layer zipf${a}_w4 4 "$a" --routing "zipf:$a"
    case $a in 1|2) run layer_zipf${a}_w4_ultraep "$RDEP" bench layer --ranks 4 --expert-compute cutlass --routing "zipf:$a" \
      --balance ultraep --json "$R/layer_zipf${a}_w4_ultraep.json" --baseline-json "$R/torch_zipf${a}_w4.json" ;; esac
  done
}
stage_reduce() {
  run check_reduce_w4 "$RDEP" check --backend cuda --ranks 4 --tokens 64 --hidden 256 --ffn 128 --experts 16 --topk 4 \
    --routing zipf:1 --capacity-factor 0.9 --owner-reduce --json "$R/check_reduce_w4.json"
  run check_reduce_w4_bal "$RDEP" check --backend cuda --ranks 4 --tokens 64 --hidden 256 --ffn 128 --experts 16 --topk 4 \
    --routing zipf:2 --balance ultraep --owner-reduce --json "$R/check_reduce_w4_bal.json"
  for round in a b; do
    run layer_w4_rows_$round "$RDEP" bench layer --ranks 4 --expert-compute cutlass --json "$R/layer_w4_rows_$round.json"
    run layer_w4_reduce_$round "$RDEP" bench layer --ranks 4 --expert-compute cutlass --owner-reduce --json "$R/layer_w4_reduce_$round.json"
  done
}
stage_scatter() {
  run check_scatter_token_w4 env RDEP_SCATTER=token "$RDEP" check --backend cuda --ranks 4 --tokens 64 --hidden 256 --ffn 128 \
    --experts 16 --topk 4 --routing zipf:1 --capacity-factor 0.9 --segment 40 --json "$R/check_scatter_token_w4.json"
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  for round in a b; do
    for k in token pair; do
      run dispatch_w4_${k}_$round env RDEP_SCATTER=$k "$RDEP" bench dispatch --ranks 4 "${moon[@]}" --json "$R/dispatch_w4_${k}_$round.json"
    done
  done
  for k in token pair; do
    run dispatch_dsv3_w4_$k env RDEP_SCATTER=$k "$RDEP" bench dispatch --ranks 4 --tokens 4096 --hidden 7168 --experts 256 --topk 8 \
      --warmup 20 --iters 100 --json "$R/dispatch_dsv3_w4_$k.json"
  done
}
stage_sms() {
  run check_sms_w4 "$RDEP" check --backend cuda --ranks 4 --tokens 64 --hidden 256 --ffn 128 --experts 16 --topk 4 \
    --routing zipf:1 --capacity-factor 0.9 --segment 40 --transport-sms 2 --json "$R/check_sms_w4.json"
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  for sms in 0 8 16 32 64 132; do
    run dispatch_w4_sms$sms "$RDEP" bench dispatch --ranks 4 "${moon[@]}" --transport-sms "$sms" --json "$R/dispatch_w4_sms$sms.json"
  done
  for sms in 0 32; do
    run layer_w4_sms$sms "$RDEP" bench layer --ranks 4 --expert-compute cutlass --transport-sms "$sms" --json "$R/layer_w4_sms$sms.json"
  done
}
stage_memory() {
  for c in 1.0 1.25; do
    run layer_w4_cap$c "$RDEP" bench layer --ranks 4 --expert-compute cutlass --capacity-factor "$c" --json "$R/layer_w4_cap$c.json"
    run layer_w4_cap${c}_reduce "$RDEP" bench layer --ranks 4 --expert-compute cutlass --capacity-factor "$c" --owner-reduce \
      --json "$R/layer_w4_cap${c}_reduce.json"
  done
  for n in 4 8; do
    run layer_w4_stack$n "$RDEP" bench layer --ranks 4 --expert-compute cutlass --layers "$n" --warmup 5 --iters 20 \
      --json "$R/layer_w4_stack$n.json"
    run layer_w4_stack${n}_reduce "$RDEP" bench layer --ranks 4 --expert-compute cutlass --owner-reduce --layers "$n" --warmup 5 \
      --iters 20 --json "$R/layer_w4_stack${n}_reduce.json"
  done
}
stage_dsv3() {
  local ds=(--hidden 7168 --ffn 2048 --experts 256 --topk 8)
  run torch_dsv3_w4 torchrun --nproc-per-node=4 "$BASE" "${ds[@]}" --iters 20 --json "$R/torch_dsv3_w4.json"
  run layer_dsv3_w4 "$RDEP" bench layer --ranks 4 --expert-compute cutlass "${ds[@]}" --warmup 5 --iters 30 \
    --json "$R/layer_dsv3_w4.json" --baseline-json "$R/torch_dsv3_w4.json"
}
stage_combine() {
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  for round in a b; do  # the per-slot return's row order, alternated (transport only, no baseline)
    for ord in grouped spread; do
      for r in uniform zipf:1 zipf:2; do
        run dispatch_w4_${ord}_${r/:/}_$round env RDEP_RETURN_ORDER=$ord "$RDEP" bench dispatch --ranks 4 "${moon[@]}" --routing "$r" \
          --no-nccl --json "$R/dispatch_w4_${ord}_${r/:/}_$round.json"
      done
    done
  done
  run dispatch_reduce_w2 "$RDEP" bench dispatch --ranks 2 "${moon[@]}" --owner-reduce --json "$R/dispatch_reduce_w2.json"
  run dispatch_reduce_w4 "$RDEP" bench dispatch --ranks 4 "${moon[@]}" --owner-reduce --json "$R/dispatch_reduce_w4.json"
  run dispatch_reduce_zipf1_w4 "$RDEP" bench dispatch --ranks 4 "${moon[@]}" --routing zipf:1 --owner-reduce \
    --json "$R/dispatch_reduce_zipf1_w4.json"
  run dispatch_reduce_dsv3_w4 "$RDEP" bench dispatch --ranks 4 --tokens 4096 --hidden 7168 --experts 256 --topk 8 --warmup 20 \
    --iters 100 --owner-reduce --json "$R/dispatch_reduce_dsv3_w4.json"
}
stage_overlap() {  # OV_W ranks (default 4; 2 on a 2-GPU machine), Moonlight's 4096 tokens per rank
  local w=${OV_W:-4}
  local s2=$((w * 4096 / 2)) s4=$((w * 4096 / 4))
  local small=(--tokens 64 --hidden 256 --ffn 128 --experts 16 --topk 4 --expert-compute cutlass)
  run check_overlap_w$w "$RDEP" check --backend cuda --ranks "$w" "${small[@]}" --routing zipf:1 --segment 40 --overlap \
    --json "$R/check_overlap_w$w.json"
  run check_overlap_w4g1 "$RDEP" check --backend cuda --ranks 4 --gpus 1 "${small[@]}" --routing zipf:1.5 --capacity-factor 0.9 \
    --segment 24 --overlap --transport-sms 8 --json "$R/check_overlap_w4g1.json"
  local lay=(bench layer --ranks "$w" --expert-compute cutlass)
  for round in a b; do
    run ov_w${w}_one_$round "$RDEP" "${lay[@]}" --json "$R/ov_w${w}_one_$round.json"
    run ov_w${w}_s${s2}_seq_$round "$RDEP" "${lay[@]}" --segment "$s2" --json "$R/ov_w${w}_s${s2}_seq_$round.json"
    run ov_w${w}_s${s2}_ov_$round "$RDEP" "${lay[@]}" --segment "$s2" --overlap --json "$R/ov_w${w}_s${s2}_ov_$round.json"
    run ov_w${w}_s${s2}_ov16_$round "$RDEP" "${lay[@]}" --segment "$s2" --overlap --transport-sms 16 --json "$R/ov_w${w}_s${s2}_ov16_$round.json"
  done
  run ov_w${w}_s${s2}_ov32 "$RDEP" "${lay[@]}" --segment "$s2" --overlap --transport-sms 32 --json "$R/ov_w${w}_s${s2}_ov32.json"
  run ov_w${w}_s${s4}_seq "$RDEP" "${lay[@]}" --segment "$s4" --json "$R/ov_w${w}_s${s4}_seq.json"
  run ov_w${w}_s${s4}_ov16 "$RDEP" "${lay[@]}" --segment "$s4" --overlap --transport-sms 16 --json "$R/ov_w${w}_s${s4}_ov16.json"
}
stage_pair() {
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  run dispatch_moonlight_w2 "$RDEP" bench dispatch --ranks 2 "${moon[@]}" --json "$R/dispatch_moonlight_w2.json"
  run dispatch_zipf1_w2 "$RDEP" bench dispatch --ranks 2 "${moon[@]}" --routing zipf:1 --json "$R/dispatch_zipf1_w2.json"
  run dispatch_dsv3_w2 "$RDEP" bench dispatch --ranks 2 --tokens 4096 --hidden 7168 --experts 256 --topk 8 --warmup 20 --iters 100 \
    --json "$R/dispatch_dsv3_w2.json"
  layer w2 2 0
  run layer_w2_reduce "$RDEP" bench layer --ranks 2 --expert-compute cutlass --owner-reduce --json "$R/layer_w2_reduce.json" \
    --baseline-json "$R/torch_w2.json"
}
stage_pairskew() {
  for a in 1 2; do
    run layer_zipf${a}_w2 "$RDEP" bench layer --ranks 2 --expert-compute cutlass --routing "zipf:$a" --json "$R/layer_zipf${a}_w2.json"
    run layer_zipf${a}_w2_ultraep "$RDEP" bench layer --ranks 2 --expert-compute cutlass --routing "zipf:$a" --balance ultraep \
      --json "$R/layer_zipf${a}_w2_ultraep.json"
  done
}
stage_gate2() {  # GATE_W ranks (default 2; 4 on a 4-GPU machine, or call stage gate4)
  local w=${GATE_W:-2}
  for a in 1 2; do
    run gate_zipf${a}_w${w}_off "$RDEP" bench layer --ranks "$w" --expert-compute cutlass --routing "zipf:$a" \
      --json "$R/gate_zipf${a}_w${w}_off.json"
    run gate_zipf${a}_w${w}_ultraep "$RDEP" bench layer --ranks "$w" --expert-compute cutlass --routing "zipf:$a" --balance ultraep \
      --json "$R/gate_zipf${a}_w${w}_ultraep.json"
    run gate_zipf${a}_w${w}_gain "$RDEP" bench layer --ranks "$w" --expert-compute cutlass --routing "zipf:$a" --balance ultraep \
      --min-gain 2500 --json "$R/gate_zipf${a}_w${w}_gain.json"
  done
}
stage_gate4() { GATE_W=4 stage_gate2; }
stage_binding2() {  # graph1 at W = 2 (2-GPU machine): the binding under torchrun (one rank a process) beside rdep bench layer
                    # --ranks 2 --gpus 2 on the same routing (every rank's draw, --routing-out FILE.rank<r>), eager and captured
  local env=(env PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  for t in 256 4096; do
    local shape=(--tokens $t --hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert)
    run layer_graph_w2_t$t "$RDEP" bench layer --ranks 2 --gpus 2 "${shape[@]}" --grads bf16 --graph \
      --routing-out "$R/routing_w2_t$t.bin" --json "$R/layer_graph_w2_t$t.json"
    run torch_graph_w2_t$t "${env[@]}" torchrun --nproc-per-node=2 bench/torch_layer_bench.py "${shape[@]}" --graph \
      --routing-from "$R/routing_w2_t$t.bin" --json "$R/torch_graph_w2_t$t.json"
  done
}
stage_binding1() {
  local env=(env RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1)
  for round in a b; do
    run binding_torch_$round "${env[@]}" python3 bench/torch_layer_bench.py --expert-compute cutlass --json "$R/binding_torch_$round.json"
    run binding_layer_$round "$RDEP" bench layer --ranks 1 --gpus 1 --expert-compute cutlass --grads bf16 --json "$R/binding_layer_$round.json"
  done
}
stage_stack2() {
  for n in 4 8; do
    run layer_w2_stack$n "$RDEP" bench layer --ranks 2 --expert-compute cutlass --layers "$n" --warmup 5 --iters 20 \
      --json "$R/layer_w2_stack$n.json"
  done
}
stage_train2() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$R/pip.log" 2>&1
  run train_w2 env PYTHONPATH="/tmp/site:$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" PYTHONUNBUFFERED=1 \
    torchrun --nproc-per-node=2 examples/torch_training/train.py --device cuda --moe both --expert-compute cutlass \
    --json "$R/train_w2.json" --png "$R/train_w2.png"
}
stage_train() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$R/pip.log" 2>&1
  local env=(env PYTHONPATH="/tmp/site:$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" PYTHONUNBUFFERED=1)
  local tr=(torchrun --nproc-per-node=4 examples/torch_training/train.py --device cuda --moe both --expert-compute cutlass)
  run train_w4 "${env[@]}" "${tr[@]}" --json "$R/train_w4.json" --png "$R/train_w4.png"
  run train_w4_compile "${env[@]}" "${tr[@]}" --compile --json "$R/train_w4_compile.json" --png "$R/train_w4_compile.png"
}
stage_one() {
  run torch_w1 torchrun --nproc-per-node=1 "$BASE" --json "$R/torch_w1.json"
  run layer_w1 "$RDEP" bench layer --ranks 1 --expert-compute cutlass --graph --json "$R/layer_w1.json" --baseline-json "$R/torch_w1.json"
  run layer_w1_bf16 "$RDEP" bench layer --ranks 1 --expert-compute cutlass --grads bf16 --json "$R/layer_w1_bf16.json" \
    --baseline-json "$R/torch_w1.json"
}
stage_rows() {  # the owner's rows in one set (dx over dout, the SwiGLU scratch D_ff a row): memory and time at W = 4 and 1
  layer w4 4 0
  local lay=(bench layer --ranks 4 --expert-compute cutlass)
  run layer_w4_bf16 "$RDEP" "${lay[@]}" --grads bf16 --json "$R/layer_w4_bf16.json" --baseline-json "$R/torch_w4.json"
  run layer_w4_s8192_ov16 "$RDEP" "${lay[@]}" --segment 8192 --overlap --transport-sms 16 --json "$R/layer_w4_s8192_ov16.json"
  run layer_w4_s4096_ov16 "$RDEP" "${lay[@]}" --segment 4096 --overlap --transport-sms 16 --json "$R/layer_w4_s4096_ov16.json"
  run layer_w4_cublaslt "$RDEP" bench layer --ranks 4 --json "$R/layer_w4_cublaslt.json"
  run layer_zipf1_w4_ultraep "$RDEP" "${lay[@]}" --routing zipf:1 --balance ultraep --json "$R/layer_zipf1_w4_ultraep.json"
  stage_one
}
stage_rows2() {  # the owner's rows in one set over NVLink at W = 2 (2-GPU machine): the layer beside the baseline, the pipeline
  layer w2 2 0
  local lay=(bench layer --ranks 2 --expert-compute cutlass)
  run layer_w2_bf16 "$RDEP" "${lay[@]}" --grads bf16 --json "$R/layer_w2_bf16.json" --baseline-json "$R/torch_w2.json"
  run layer_w2_s4096_ov16 "$RDEP" "${lay[@]}" --segment 4096 --overlap --transport-sms 16 --json "$R/layer_w2_s4096_ov16.json"
  run layer_w2_cublaslt "$RDEP" bench layer --ranks 2 --json "$R/layer_w2_cublaslt.json"
}
stage_checks() {  # rdep check --backend cuda with each expert compute: W = 1, W = 4 ranks sharing GPU 0, W = NGPU on every GPU
  local n; n=$(nvidia-smi -L | wc -l)
  for ec in cutlass cublaslt; do
    run check_${ec}_w1 "$RDEP" check --backend cuda --ranks 1 --expert-compute "$ec" --json "$R/check_${ec}_w1.json"
    run check_${ec}_w4g1 "$RDEP" check --backend cuda --ranks 4 --gpus 1 --expert-compute "$ec" --routing zipf:1 \
      --json "$R/check_${ec}_w4g1.json"
    [ "$n" -gt 1 ] && run check_${ec}_w$n "$RDEP" check --backend cuda --ranks "$n" --gpus "$n" --expert-compute "$ec" \
      --routing zipf:1 --capacity-factor 0.9 --json "$R/check_${ec}_w$n.json"
  done
  [ "$n" -gt 1 ] && run check_stash_w$n "$RDEP" check --backend cuda --ranks "$n" --gpus "$n" --expert-compute cutlass \
    --stash-rows 2048 --routing zipf:1 --json "$R/check_stash_w$n.json"
  run check_cutlass_w4g1_bal "$RDEP" check --backend cuda --ranks 4 --gpus 1 --expert-compute cutlass --routing zipf:2 \
    --balance ultraep --json "$R/check_cutlass_w4g1_bal.json"
}
stage_gate() {  # LayerConfig::gate_in_expert: rdep check with it, then the layer with and without it, alternated, W = 1 and W = every GPU
  local n; n=$(nvidia-smi -L | wc -l)
  local chk=(check --backend cuda --expert-compute cutlass --gate-in-expert)
  run check_gate_w1 "$RDEP" "${chk[@]}" --ranks 1 --json "$R/check_gate_w1.json"
  run check_gate_w4g1 "$RDEP" "${chk[@]}" --ranks 4 --gpus 1 --routing zipf:1 --capacity-factor 0.9 --json "$R/check_gate_w4g1.json"
  run check_gate_w4g1_overlap "$RDEP" "${chk[@]}" --ranks 4 --gpus 1 --routing zipf:1.5 --segment 40 --overlap --json "$R/check_gate_w4g1_overlap.json"
  run check_gate_w4g1_stash "$RDEP" "${chk[@]}" --ranks 4 --gpus 1 --routing zipf:1 --stash-rows 4096 --json "$R/check_gate_w4g1_stash.json"
  [ "$n" -gt 1 ] && run check_gate_w$n "$RDEP" "${chk[@]}" --ranks "$n" --gpus "$n" --routing zipf:1 --json "$R/check_gate_w$n.json"
  for w in 1 $([ "$n" -gt 1 ] && echo "$n"); do
    [ -f "$R/torch_w$w.json" ] || run torch_w$w torchrun --nproc-per-node="$w" "$BASE" --json "$R/torch_w$w.json"
    local lay=(bench layer --ranks "$w" --expert-compute cutlass --baseline-json "$R/torch_w$w.json")
    for round in a b; do
      run gate_w${w}_off_$round "$RDEP" "${lay[@]}" --json "$R/gate_w${w}_off_$round.json"
      run gate_w${w}_on_$round "$RDEP" "${lay[@]}" --gate-in-expert --json "$R/gate_w${w}_on_$round.json"
    done
    run gate_w${w}_on_bf16 "$RDEP" "${lay[@]}" --gate-in-expert --grads bf16 --json "$R/gate_w${w}_on_bf16.json"
    run gate_w${w}_off_bf16 "$RDEP" "${lay[@]}" --grads bf16 --json "$R/gate_w${w}_off_bf16.json"
  done
}
stage_gather1() {  # the scaled gather vectorized: the W = 1 layer against BASE_REV's rdep (default 8baccfd), alternated
  local base; base=$(bash scripts/build_rev.sh "${BASE_REV:-8baccfd}" 2>"$R/build_rev.log" | tail -1)
  [ -x "$base" ] || { echo "gather1: no base binary (see build_rev.log)" >>"$LOG"; fails=$((fails + 1)); return; }
  local lay=(bench layer --ranks 1)
  for round in a b; do
    run gather_w1_base_$round "$base" "${lay[@]}" --expert-compute cutlass --json "$R/gather_w1_base_$round.json"
    run gather_w1_new_$round "$RDEP" "${lay[@]}" --expert-compute cutlass --json "$R/gather_w1_new_$round.json"
  done
  run gather_w1_base_lt "$base" "${lay[@]}" --json "$R/gather_w1_base_lt.json"
  run gather_w1_new_lt "$RDEP" "${lay[@]}" --json "$R/gather_w1_new_lt.json"
  run gather_w1_new_gate "$RDEP" "${lay[@]}" --expert-compute cutlass --gate-in-expert --json "$R/gather_w1_new_gate.json"
}
stage_gate1r() {  # gate_in_expert with owner_reduce on one GPU: rdep check (4 ranks sharing GPU 0), memory at W = 4 sharing, W = 1 times
  local chk=(check --backend cuda --ranks 4 --gpus 1 --expert-compute cutlass --owner-reduce --gate-in-expert)
  run check_gate_reduce_w4g1 "$RDEP" "${chk[@]}" --routing zipf:1 --capacity-factor 0.9 --json "$R/check_gate_reduce_w4g1.json"
  run check_gate_reduce_w4g1_stash "$RDEP" "${chk[@]}" --routing zipf:2 --segment 40 --stash-rows 4096 --json "$R/check_gate_reduce_w4g1_stash.json"
  local lay=(bench layer --expert-compute cutlass --owner-reduce)
  run gate_reduce_w4g1_off "$RDEP" "${lay[@]}" --ranks 4 --gpus 1 --warmup 3 --iters 10 --json "$R/gate_reduce_w4g1_off.json"
  run gate_reduce_w4g1_on "$RDEP" "${lay[@]}" --ranks 4 --gpus 1 --warmup 3 --iters 10 --gate-in-expert --json "$R/gate_reduce_w4g1_on.json"
  for round in a b; do
    run gate_reduce_w1_off_$round "$RDEP" "${lay[@]}" --ranks 1 --json "$R/gate_reduce_w1_off_$round.json"
    run gate_reduce_w1_on_$round "$RDEP" "${lay[@]}" --ranks 1 --gate-in-expert --json "$R/gate_reduce_w1_on_$round.json"
  done
}
stage_rows1() {  # the same on one GPU: stage one (W = 1), then W = 4 ranks sharing GPU 0 (per-rank memory; times not NVLink's)
  stage_one
  local lay=(bench layer --ranks 4 --gpus 1 --expert-compute cutlass --warmup 3 --iters 10)
  run layer_w4g1 "$RDEP" "${lay[@]}" --json "$R/layer_w4g1.json"
  run layer_w4g1_bf16 "$RDEP" "${lay[@]}" --grads bf16 --json "$R/layer_w4g1_bf16.json"
  run layer_w4g1_s8192_ov "$RDEP" "${lay[@]}" --segment 8192 --overlap --json "$R/layer_w4g1_s8192_ov.json"
  run layer_w4g1_s4096_ov "$RDEP" "${lay[@]}" --segment 4096 --overlap --json "$R/layer_w4g1_s4096_ov.json"
}
stage_stack1() {
  run layer_w1_stack4 "$RDEP" bench layer --ranks 1 --expert-compute cutlass --layers 4 --warmup 5 --iters 20 --json "$R/layer_w1_stack4.json"
}
stage_seg1() {
  run check_seg_w4 "$RDEP" check --backend cuda --gpus 1 --ranks 4 --expert-compute cutlass --segment 24 --routing zipf:1.2 \
    --json "$R/check_seg_w4.json"
  run check_seg_w4_reduce "$RDEP" check --backend cuda --gpus 1 --ranks 4 --expert-compute cutlass --segment 40 --owner-reduce \
    --capacity-factor 1.0 --json "$R/check_seg_w4_reduce.json"
  [ -f "$R/torch_w1.json" ] || run torch_w1 torchrun --nproc-per-node=1 "$BASE" --json "$R/torch_w1.json"
  run layer_w1_seg1024 "$RDEP" bench layer --ranks 1 --expert-compute cutlass --segment 1024 --graph --json "$R/layer_w1_seg1024.json" \
    --baseline-json "$R/torch_w1.json"
  run layer_w1_seg1024_lt "$RDEP" bench layer --ranks 1 --segment 1024 --json "$R/layer_w1_seg1024_lt.json" --baseline-json "$R/torch_w1.json"
}
stage_train1() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$R/pip.log" 2>&1
  run train_w1 env PYTHONPATH="/tmp/site:$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" PYTHONUNBUFFERED=1 \
    python3 examples/torch_training/train.py --device cuda --moe both --expert-compute cutlass --json "$R/train_w1.json" --png "$R/train_w1.png"
}
stage_train1c() {  # TRAIN_TAG (default empty) names the receipts of a run with TRAIN_ARGS (extra train.py flags)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$R/pip.log" 2>&1
  local tag=${TRAIN_TAG:-}
  # shellcheck disable=SC2086
  run train_w1_compile$tag env PYTHONPATH="/tmp/site:$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" PYTHONUNBUFFERED=1 \
    python3 examples/torch_training/train.py --device cuda --moe both --expert-compute cutlass --compile ${TRAIN_ARGS:-} \
    --json "$R/train_w1_compile$tag.json" --png "$R/train_w1_compile$tag.png"
}
stage_train1cg() { TRAIN_TAG=_gate TRAIN_ARGS="--gate-in-expert on --memory-step 30" stage_train1c; }
stage_peak1() {  # the training example's torch allocations at step 30's peak, both variants (snapshots kept in /tmp)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$R/pip.log" 2>&1
  run train_w1_peak env PYTHONPATH="/tmp/site:$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" PYTHONUNBUFFERED=1 \
    python3 examples/torch_training/train.py --device cuda --moe both --expert-compute cutlass --compile --steps 40 \
    --memory-step 30 --memory-snapshot /tmp/snap --json "$R/train_w1_peak.json"
  for v in rdep torchtitan; do
    run peak_$v python3 scripts/snapshot_peak.py /tmp/snap.$v.r0.pickle --frames 4 --top 40
  done
}
stage_swiglu1() {  # ncu (no clock control) on the SwiGLU kernels of the W = 1 Moonlight layer, with and without the gate
  for g in off on; do
    local flag=(); [ $g = on ] && flag=(--gate-in-expert)
    run swiglu_ncu_$g ncu --clock-control none -k regex:Swiglu -c 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      "$RDEP" bench layer --ranks 1 --gpus 1 --expert-compute cutlass "${flag[@]}" --warmup 1 --iters 1
  done
}
stage_mem1() {  # the layer's memory per rank with one payload buffer (S >= W*T): W = 1 and 4 ranks sharing GPU 0, gate on
  run mem_w1_gate "$RDEP" bench layer --ranks 1 --gpus 1 --expert-compute cutlass --gate-in-expert --warmup 10 --iters 100 \
    --json "$R/mem_w1_gate.json"
  run mem_w4g1_gate_reduce "$RDEP" bench layer --ranks 4 --gpus 1 --expert-compute cutlass --gate-in-expert --owner-reduce \
    --warmup 3 --iters 10 --json "$R/mem_w4g1_gate_reduce.json"
}
train_env() {  # RDEP_W1_RETURN, when set, written into the command line (its log shows it)
  echo env PYTHONPATH="/tmp/site:$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" PYTHONUNBUFFERED=1 \
    ${RDEP_W1_RETURN:+RDEP_W1_RETURN=$RDEP_W1_RETURN}
}
WHEELS_IN=0
pip_wheels() {  # the wheels into /tmp/site, once per run of this script
  [ "$WHEELS_IN" = 1 ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >"$R/pip.log" 2>&1 &&
    WHEELS_IN=1
}
stage_prof1() {
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_prof $(train_env) python3 examples/torch_training/train.py --device cuda --moe both --expert-compute cutlass \
    --compile --steps 40 --profile-steps 3 --profile-at 25 --json "$R/train_w1_prof.json"
}
stage_trainro() {
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_ro $(train_env) python3 examples/torch_training/train.py --device cuda --moe both \
    --compile-mode reduce-overhead --profile-steps 3 --profile-at 100 --json "$R/train_w1_ro.json" --png "$R/train_w1_ro.png"
}
stage_trainrop() {  # trainro with rdep's plain ops (--capturable-ops off: run between the captured partitions), the A/B
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_rop $(train_env) python3 examples/torch_training/train.py --device cuda --moe both \
    --compile-mode reduce-overhead --capturable-ops off --json "$R/train_w1_rop.json"
}
stage_trainrok() {  # trainro with rdep's --keep-weight-casts (the forward's casts saved for the backward, as TorchTitan's are)
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_rok $(train_env) python3 examples/torch_training/train.py --device cuda --moe both \
    --compile-mode reduce-overhead --keep-weight-casts --profile-steps 3 --profile-at 100 --json "$R/train_w1_rok.json"
}
stage_trainroik() {  # trainrok interleaved (both models resident, stepped in turn; memory not measured)
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_roik $(train_env) python3 examples/torch_training/train.py --device cuda --moe both \
    --compile-mode reduce-overhead --keep-weight-casts --interleave --json "$R/train_w1_roik.json"
}
stage_trainsep() {  # reduce-overhead, each model in a process of its own (no shared graph pool or dynamo state):
  pip_wheels      # TorchTitan's MoE, rdep with --keep-weight-casts (all, after-first), rdep without; 200 steps each
  # shellcheck disable=SC2046
  run train_w1_sep_tt $(train_env) python3 examples/torch_training/train.py --device cuda --moe torchtitan \
    --compile-mode reduce-overhead --json "$R/train_w1_sep_tt.json"
  # shellcheck disable=SC2046
  run train_w1_sep_rdepk $(train_env) python3 examples/torch_training/train.py --device cuda --moe rdep \
    --compile-mode reduce-overhead --keep-weight-casts --json "$R/train_w1_sep_rdepk.json"
  # shellcheck disable=SC2046
  run train_w1_sep_rdepa $(train_env) python3 examples/torch_training/train.py --device cuda --moe rdep \
    --compile-mode reduce-overhead --keep-weight-casts after-first --json "$R/train_w1_sep_rdepa.json"
  # shellcheck disable=SC2046
  run train_w1_sep_rdep $(train_env) python3 examples/torch_training/train.py --device cuda --moe rdep \
    --compile-mode reduce-overhead --keep-weight-casts none --json "$R/train_w1_sep_rdep.json"
}
train_ro() {  # train_ro NAME MOE [train.py flags...]: the example on one GPU under reduce-overhead, its receipt $R/NAME.json
  local name=$1 moe=$2; shift 2
  # shellcheck disable=SC2046
  run "$name" $(train_env) python3 examples/torch_training/train.py --device cuda --moe "$moe" --compile-mode reduce-overhead \
    "$@" --json "$R/$name.json"
}
stage_trainpair() {  # trainsep's first pair only: TorchTitan's MoE, then rdep with the example's defaults (after-first)
  pip_wheels
  train_ro train_w1_pair_tt torchtitan
  train_ro train_w1_pair_rdep rdep
}
train_ga() {  # train_ga NAME MOE [train.py flags...]: train_ro with --grad-accum 4, GA_STEPS steps (default 100)
  local name=$1 moe=$2; shift 2
  train_ro "$name" "$moe" --grad-accum 4 --steps "${GA_STEPS:-100}" "$@"
}
train_prof() {  # train_prof TAG MOE [train.py flags...]: 104 steps under reduce-overhead, steps 100-102 profiled, then the
  local tag=$1 moe=$2; shift 2  # trace's kernels per step (bench/trace_kernels.py); the trace stays outside $R (not archived)
  local trace=/tmp/rdep_traces/trace_$tag
  mkdir -p /tmp/rdep_traces
  train_ro "train_w1_prof_$tag" "$moe" "$@" --steps 104 --profile-steps 3 --profile-at 100 --profile-trace "$trace"
  run "kernels_$tag" python3 bench/trace_kernels.py "$trace.$moe.r0.json" --steps 3 --top 80 --sequence --gaps 30 --waits 100
}
stage_trainip() {  # trainpair, then rdep again with RDEP_W1_RETURN=copy (the return's copy at W = 1, before the in-place combine)
  pip_wheels
  train_ro train_w1_ip_tt torchtitan
  train_ro train_w1_ip_rdep rdep
  RDEP_W1_RETURN=copy train_ro train_w1_ip_rdep_copy rdep
}
stage_trainmw() {  # TorchTitan's MoE, rdep with fp32 experts, rdep with --expert-weights bf16-master (bf16 experts, fp32
  pip_wheels      # masters in rdep.torch.MasterAdamW); TRAIN_SEED, when set, is every run's --seed (receipts named _sN)
  local sfx=${TRAIN_SEED:+_s$TRAIN_SEED}
  train_ro "train_w1_mw_tt$sfx" torchtitan ${TRAIN_SEED:+--seed "$TRAIN_SEED"}
  train_ro "train_w1_mw_rdep$sfx" rdep --expert-weights fp32 ${TRAIN_SEED:+--seed "$TRAIN_SEED"}
  train_ro "train_w1_mw_rdep_master$sfx" rdep --expert-weights bf16-master ${TRAIN_SEED:+--seed "$TRAIN_SEED"}
}
stage_trainmwtt() {  # TorchTitan's MoE and rdep, both with bf16 experts and fp32 masters in MasterAdamW (only the MoE differs)
  pip_wheels
  train_ro train_w1_mwtt_tt torchtitan --baseline-expert-weights bf16-master
  train_ro train_w1_mwtt_rdep rdep --expert-weights bf16-master
}
stage_optimmw() {  # the expert weights' optimizer step alone: MasterAdamW against torch's fused AdamW, the casts, the clip's pass
  pip_wheels
  # shellcheck disable=SC2046
  run optim_step $(train_env) python3 bench/optim_step.py --json "$R/optim_step.json"
}
stage_trainprofmw() {  # trainprof's rdep run with --expert-weights bf16-master: its kernels per step
  pip_wheels
  train_prof rdep_mw rdep --expert-weights bf16-master
}
stage_trainmwga() {  # rdep with --grad-accum 4 (GA_STEPS steps): fp32 experts, then bf16-master (MasterAdamW(fp32_grads=True):
  pip_wheels       # the micro-batches' expert gradients summed in fp32)
  train_ga train_w1_mwga_rdep rdep --expert-weights fp32
  train_ga train_w1_mwga_rdep_master rdep --expert-weights bf16-master
}
stage_trainpairga() {  # trainpair with gradient accumulation: the optimizer and the clip once per 4 micro-batches
  pip_wheels
  train_ga train_w1_pairga_tt torchtitan
  train_ga train_w1_pairga_rdep rdep
}
stage_trainprof() {  # trainpair's two runs (each model in its own process), 104 steps, steps 100-102 profiled: each
  pip_wheels         # trace's kernels summed per step with full names and one step in order (bench/trace_kernels.py)
  train_prof torchtitan torchtitan
  train_prof rdep rdep
}
stage_trainor() {  # trainpair (200 steps, each model in its own process) and rdep again with --owner-reduce
  pip_wheels
  stage_trainpair
  train_ro train_w1_pair_rdep_or rdep --owner-reduce
}
stage_trainrep() {  # trainpair's two runs twice, alternated (TorchTitan, rdep, TorchTitan, rdep): the spread between runs
  pip_wheels
  local i v
  for i in 1 2; do
    for v in torchtitan rdep; do train_ro "train_w1_rep${i}_$v" "$v"; done
  done
}
stage_trainwarm() {  # the first step's time on a cold and a warm compile cache (the example's --autograd-cache-functions)
  pip_wheels
  export TORCHINDUCTOR_CACHE_DIR=/tmp/rdep_inductor_trainwarm
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
  train_ro train_w1_warm_cold rdep --steps 30
  train_ro train_w1_warm_on rdep --steps 30
  train_ro train_w1_warm_off rdep --steps 30 --autograd-cache-functions off
  train_ro train_w1_warm_on2 rdep --steps 30
  unset TORCHINDUCTOR_CACHE_DIR
}
stage_trainov() {  # trainpair with each --timing, alternated: TorchTitan and rdep synced, then both overlapped
  pip_wheels
  local t
  for t in synced overlapped; do
    train_ro "train_w1_${t}_tt" torchtitan --timing "$t"
    train_ro "train_w1_${t}_rdep" rdep --timing "$t"
  done
}
stage_trainbwac() {  # the compiled backward's autocast (--compiled-backward-autocast): TorchTitan and rdep synced with
  pip_wheels         # the example's default (off), then both with torch's default (same_as_forward), then both overlapped
  local m            # (off), then both models' profiles (off): their kernels a step
  for m in off same_as_forward; do
    train_ro "train_w1_synced_tt_$m" torchtitan --compiled-backward-autocast "$m"
    train_ro "train_w1_synced_rdep_$m" rdep --compiled-backward-autocast "$m"
  done
  train_ro train_w1_overlapped_tt torchtitan --timing overlapped --compiled-backward-autocast off
  train_ro train_w1_overlapped_rdep rdep --timing overlapped --compiled-backward-autocast off
  train_prof rdep rdep --compiled-backward-autocast off
  train_prof torchtitan torchtitan --compiled-backward-autocast off
}
stage_trainprofor() {  # trainprof's rdep run with --owner-reduce: its kernels per step
  pip_wheels
  train_prof rdep_or rdep --owner-reduce
}
stage_trainpairgaor() {  # trainpairga's runs and rdep with --owner-reduce between them (TorchTitan, rdep --owner-reduce, rdep)
  pip_wheels
  train_ga train_w1_pairgaor_tt torchtitan
  train_ga train_w1_pairgaor_rdep_or rdep --owner-reduce
  train_ga train_w1_pairgaor_rdep rdep
}
stage_trainpaire() {  # trainpair eagerly (no torch.compile): rdep's MoE blocks through rdep.torch's eager C++ path
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_paire_tt $(train_env) python3 examples/torch_training/train.py --device cuda --moe torchtitan \
    --json "$R/train_w1_paire_tt.json"
  # shellcheck disable=SC2046
  run train_w1_paire_rdep $(train_env) python3 examples/torch_training/train.py --device cuda --moe rdep \
    --json "$R/train_w1_paire_rdep.json"
}
train2() {  # train2 NAME [train.py flags...]: the example under torchrun --nproc-per-node=2, 200 steps
  local name=$1; shift
  # shellcheck disable=SC2046
  run "$name" $(train_env) torchrun --nproc-per-node=2 examples/torch_training/train.py --device cuda "$@" --json "$R/$name.json"
}
stage_train2sep() {  # trainsep's protocol at W = 2 under torchrun (one rank a process, a GPU each; 2-GPU machine)
  pip_wheels
  train2 train_w2_sep_tt --compile-mode reduce-overhead --moe torchtitan
  stage_train2rdep
  stage_train2rdepp
}
stage_train2rdep() { pip_wheels; train2 train_w2_sep_rdep --compile-mode reduce-overhead --moe rdep; }
stage_train2rdepp() { pip_wheels; train2 train_w2_sep_rdepp --compile-mode reduce-overhead --moe rdep --capturable-ops off; }
stage_train2pair() {  # each model in its best mode at W = 2: TorchTitan compiled (default mode), rdep under reduce-overhead
  pip_wheels
  train2 train_w2_pair_tt --compile --moe torchtitan
  train2 train_w2_pair_rdep --compile-mode reduce-overhead --moe rdep
}
stage_train2c() {  # both models compiled in the default mode (no CUDA graphs), each in processes of its own, W = 2
  pip_wheels
  train2 train_w2_c_tt --compile --moe torchtitan
  train2 train_w2_c_rdep --compile --moe rdep
}
stage_trainroi() {  # trainro's protocol with --interleave (both models built, stepped in turn; memory not measured)
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_roi $(train_env) python3 examples/torch_training/train.py --device cuda --moe both \
    --compile-mode reduce-overhead --interleave --json "$R/train_w1_roi.json"
}
stage_trainb32() {
  pip_wheels
  # shellcheck disable=SC2046
  run train_w1_b32 $(train_env) python3 examples/torch_training/train.py --device cuda --moe both --expert-compute cutlass \
    --compile --batch 32 --steps 60 --agree-from 30 --agree-to 60 --json "$R/train_w1_b32.json"
}
stage_host1() {  # the binding's host time per call where the GPU's work is small (the launch queue never fills)
  local small=(--tokens 256 --hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert --iters 300)
  local env=(env PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  run host_small "${env[@]}" python3 bench/torch_layer_bench.py "${small[@]}" --json "$R/host_small.json"
  run host_small_prof "${env[@]}" python3 bench/torch_layer_bench.py "${small[@]}" --iters 50 --profile 20
  run host_train_shape "${env[@]}" python3 bench/torch_layer_bench.py --tokens 4096 --hidden 1024 --ffn 704 --experts 64 \
    --topk 6 --expert-compute cutlass --gate-in-expert --json "$R/host_train_shape.json"
}
stage_graph1() {  # the binding's captured calls beside the C++ layer's (issue 15: what the binding adds), at 256 and 4096 tokens
  local env=(env PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  for t in 256 4096; do
    local shape=(--tokens $t --hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert)
    run layer_graph_t$t "$RDEP" bench layer --ranks 1 "${shape[@]}" --grads bf16 --graph --routing-out "$R/routing_t$t.bin" \
      --json "$R/layer_graph_t$t.json"
    run torch_graph_t$t "${env[@]}" python3 bench/torch_layer_bench.py "${shape[@]}" --graph --kernels 20 \
      --routing-from "$R/routing_t$t.bin" --json "$R/torch_graph_t$t.json"
  done
}
stage_native1() {  # py-spy samples the binding's eager calls natively (the wheel from .whl/, installed under /tmp/pyspy)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyspy .whl/py_spy-*.whl >/dev/null 2>&1 ||
    echo "native1: no py_spy wheel in .whl/ (the profiles are skipped)" | tee -a "$LOG"
  local env=(env PATH="$PATH:/tmp/pyspy/bin" PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  for t in 4096 256; do
    run torch_native_t$t "${env[@]}" python3 bench/torch_layer_bench.py --tokens $t --hidden 1024 --ffn 704 --experts 64 \
      --topk 6 --expert-compute cutlass --gate-in-expert --timeline 300 --native-profile 8 --json "$R/torch_native_t$t.json"
  done
}
stage_tstack1() {  # the binding's eager forward+backward per layer in a stack of 3 against the C++ layer's (issue 15)
  local env=(env PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  for t in 4096 256; do
    local shape=(--tokens $t --hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert)
    run layer_t$t "$RDEP" bench layer --ranks 1 "${shape[@]}" --grads bf16 --routing-out "$R/routing_t$t.bin" \
      --json "$R/layer_t$t.json"
    run torch_stack_t$t "${env[@]}" python3 bench/torch_layer_bench.py "${shape[@]}" --stack 3 --timeline 200 \
      --routing-from "$R/routing_t$t.bin" --json "$R/torch_stack_t$t.json"
  done
}
stage_eager1() {  # rdep.torch's eager C++ path against its Python path (--eager-ab), one layer and a stack of 3, beside the
                  # C++ layer (issue 15)
  local env=(env PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  for t in 4096 256; do
    local shape=(--tokens $t --hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert)
    run layer_t$t "$RDEP" bench layer --ranks 1 "${shape[@]}" --grads bf16 --routing-out "$R/routing_t$t.bin" \
      --json "$R/layer_t$t.json"
    run torch_eager_t$t "${env[@]}" python3 bench/torch_layer_bench.py "${shape[@]}" --stack 3 --eager-ab 4 --iters 200 \
      --timeline 200 --routing-from "$R/routing_t$t.bin" --json "$R/torch_eager_t$t.json"
  done
}
stage_eager2() {  # the eager C++ path's stack of 3 against the C++ layer's stack of 3 (--layers 3), and where its host time
                  # goes (py-spy --native, the wheel from .whl/ as native1)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyspy .whl/py_spy-*.whl >/dev/null 2>&1 ||
    echo "eager2: no py_spy wheel in .whl/ (the profiles are skipped)" | tee -a "$LOG"
  local env=(env PATH="$PATH:/tmp/pyspy/bin" PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  for t in 4096 256; do
    local shape=(--tokens $t --hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert)
    run layer_t$t "$RDEP" bench layer --ranks 1 "${shape[@]}" --grads bf16 --routing-out "$R/routing_t$t.bin" \
      --json "$R/layer_t$t.json"
    run layer_stack3_t$t "$RDEP" bench layer --ranks 1 "${shape[@]}" --grads bf16 --layers 3 --json "$R/layer_stack3_t$t.json"
    run torch_stack3_t$t "${env[@]}" python3 bench/torch_layer_bench.py "${shape[@]}" --stack 3 --iters 200 \
      --routing-from "$R/routing_t$t.bin" --native-profile 6 --json "$R/torch_stack3_t$t.json"
  done
}
stage_graph4() {  # every rank's forward (+backward) captured as one graph (CudaDomain::BeginCapture): W = 4 sharing GPU 0,
                  # and two ranks, then one, per GPU when there are several, Moonlight shape and the example's layer shape
  local gpus; gpus=$(nvidia-smi -L | wc -l)
  for shape in "--hidden 2048 --ffn 1408" "--hidden 1024 --ffn 704 --gate-in-expert"; do
    local tag; tag=$(echo "$shape" | awk '{print $2}')
    run layer_graph_w4g1_h$tag "$RDEP" bench layer --ranks 4 --gpus 1 --expert-compute cutlass $shape --graph \
      --json "$R/layer_graph_w4g1_h$tag.json"
    if [ "$gpus" -gt 1 ]; then  # two ranks per GPU, then one per GPU (barrier kernels counting epochs on the device)
      run layer_graph_w$((2 * gpus))g${gpus}_h$tag "$RDEP" bench layer --ranks $((2 * gpus)) --gpus "$gpus" --expert-compute cutlass \
        $shape --graph --json "$R/layer_graph_w$((2 * gpus))g${gpus}_h$tag.json"
      run layer_graph_w${gpus}g${gpus}_h$tag "$RDEP" bench layer --ranks "$gpus" --gpus "$gpus" --expert-compute cutlass \
        $shape --graph --json "$R/layer_graph_w${gpus}g${gpus}_h$tag.json"
    fi
  done
}
stage_stash() {
  for round in a b; do
    run layer_w1_nostash_$round "$RDEP" bench layer --ranks 1 --gpus 1 --expert-compute cutlass --warmup 10 --iters 100 \
      --json "$R/layer_w1_nostash_$round.json"
    run layer_w1_stash_$round "$RDEP" bench layer --ranks 1 --gpus 1 --expert-compute cutlass --stash-rows 24576 --warmup 10 --iters 100 \
      --json "$R/layer_w1_stash_$round.json"
  done
  run stack_w4_nostash "$RDEP" bench layer --ranks 4 --gpus 1 --expert-compute cutlass --layers 4 --warmup 2 --iters 3 \
    --json "$R/stack_w4_nostash.json"
  run stack_w4_stash "$RDEP" bench layer --ranks 4 --gpus 1 --expert-compute cutlass --layers 4 --stash-rows 106496 --warmup 2 --iters 3 \
    --json "$R/stack_w4_stash.json"
}
stage_tiles1() {
  run tiles_e16 build-dev/bench/lab/grouped_gemm_tiles --mu 128,384,768,1536,3072,6144 --iters 30 --warmup 5
}
stage_gemm1() {
  run gemm_e16 "$RDEP" bench gemm --path lt,cutlass --iters 50 --warmup 10 --json "$R/gemm_e16.json"
  run gemm_e16_bf16 "$RDEP" bench gemm --path lt,cutlass --grads bf16 --iters 50 --warmup 10 --json "$R/gemm_e16_bf16.json"
  run torch_gmm_e16 python3 bench/torch_grouped_mm.py --iters 50 --warmup 10 --backward --counts-from "$R/gemm_e16.json" \
    --json "$R/torch_gmm_e16.json"
}
stage_epi1() {
  local paths=cutlass,cutlass:ping_128x128/////,cutlass-fused,cutlass-fused:ping_128x128/////
  run gemm_epi "$RDEP" bench gemm --gate-up interleaved8 --path "$paths,$paths" --grads bf16 --mu 128,384,768,1536,3072 \
    --iters 50 --warmup 10 --json "$R/gemm_epi.json"
  run torch_gmm_epi python3 bench/torch_grouped_mm.py --iters 50 --warmup 10 --backward --counts-from "$R/gemm_epi.json" \
    --json "$R/torch_gmm_epi.json"
  for p in cutlass-fused cutlass-fused:ping_128x128///// cutlass; do
    run "ncu_epi_${p//[:\/]/_}" ncu --clock-control none -k regex:device_kernel -c 1 --section SpeedOfLight --section SchedulerStats \
      --section WarpStateStats --section SourceCounters "$RDEP" bench gemm --gate-up interleaved8 --path "$p" --mu 1536 \
      --no-backward --warmup 0 --iters 1
  done
}
stage_host2() {
  local env=(env PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  local shape=(--hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert --compile)
  run host2_small "${env[@]}" python3 bench/torch_layer_bench.py --tokens 256 "${shape[@]}" --iters 300 --host-breakdown 200 \
    --json "$R/host2_small.json"
  run host2_train "${env[@]}" python3 bench/torch_layer_bench.py --tokens 4096 "${shape[@]}" --host-breakdown 100 --cprofile 50 \
    --json "$R/host2_train.json"
}
stage_host3() {
  local env=(env PYTHONPATH="$PWD/python" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so")
  local shape=(--hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert)
  for t in 256 4096; do
    run host3_layer_t$t "$RDEP" bench layer --ranks 1 --tokens $t "${shape[@]}" --grads bf16 --iters 200 --json "$R/host3_layer_t$t.json"
    run host3_torch_t$t "${env[@]}" python3 bench/torch_layer_bench.py --tokens $t "${shape[@]}" --iters 200 --host-breakdown 200 \
      --json "$R/host3_torch_t$t.json"
  done
}
stage_gaps1() {
  pip_wheels
  # shellcheck disable=SC2046
  run gaps_train_ro $(train_env) python3 examples/torch_training/train.py --device cuda --moe both --compile-mode reduce-overhead \
    --profile-steps 3 --profile-at 100 --profile-trace /tmp/gaps_ro --json "$R/gaps_train_ro.json"
  run gaps_ro python3 scripts/trace_gaps.py /tmp/gaps_ro.rdep.r0.json /tmp/gaps_ro.torchtitan.r0.json --json "$R/gaps_ro.json"
  # shellcheck disable=SC2046
  run gaps_train_c $(train_env) python3 examples/torch_training/train.py --device cuda --moe both --compile --steps 60 \
    --agree-from 30 --agree-to 60 --profile-steps 3 --profile-at 40 --profile-trace /tmp/gaps_c --json "$R/gaps_train_c.json"
  run gaps_c python3 scripts/trace_gaps.py /tmp/gaps_c.rdep.r0.json /tmp/gaps_c.torchtitan.r0.json --json "$R/gaps_c.json"
}
stage_gemmex1() {
  local shape=(--experts 64 --hidden 1024 --ffn 704 --mu 96,384,1536 --grads bf16 --iters 50 --warmup 10)
  run gemm_ex "$RDEP" bench gemm "${shape[@]}" --path lt,cutlass,cutlass:all --json "$R/gemm_ex.json"
  run torch_gmm_ex python3 bench/torch_grouped_mm.py --iters 50 --warmup 10 --backward --counts-from "$R/gemm_ex.json" \
    --json "$R/torch_gmm_ex.json"
}
stage_tilesex() {  # the example's expert GEMMs alone per tile (device.sh --targets "rdep grouped_gemm_tiles")
  run tiles_ex build-dev/bench/lab/grouped_gemm_tiles --experts 64 --hidden 1024 --ffn 704 --mu 96,384,1536 \
    --iters 30 --warmup 5
}
stage_wgrad1() {  # the weight-gradient GEMMs as training runs them (beta 0), at the example's shape (E_loc 64) and with
  # the same tiles and bytes in 8 and 1 groups (a CTA's consecutive tiles change group: does that cost?); ncu on dW1;
  # then the example's MLP with the pingpong tile on the four other GEMMs, alternated with the defaults
  local L=build-dev/bench/lab/grouped_gemm_tiles ex="--iters 30 --warmup 5 --roles dw2,dw1 --wgrad-beta 0"
  run wgrad_e64 $L --experts 64 --hidden 1024 --ffn 704 --mu 384,1536 $ex
  run wgrad_e8 $L --experts 8 --hidden 1024 --ffn 5632 --mu 384 $ex
  run wgrad_e1 $L --experts 1 --hidden 1024 --ffn 45056 --mu 384 $ex
  stage_ncuwg
  local ping=cutlass:ping_128x128/ping_128x128/ping_128x128/ping_128x128//
  run gemm_ex_tiles "$RDEP" bench gemm --experts 64 --hidden 1024 --ffn 704 --mu 384 \
    --path "cutlass,$ping,cutlass,$ping" --iters 100 --warmup 10 --json "$R/gemm_ex_tiles.json"
}
stage_ncuwg() {  # ncu on dW1 (beta 0, its default tile) at E_loc 64 and in 1 group of the same tiles and bytes
  local L=build-dev/bench/lab/grouped_gemm_tiles
  local sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
  local one="--roles dw1 --tiles ping_128x128_c2x1 --wgrad-beta 0 --mu 384 --iters 1 --warmup 2"
  # CUTLASS's kernels are all named cutlass::device_kernel<...>: the third launch is the first timed one
  # shellcheck disable=SC2086
  run ncu_dw1_e64 ncu --clock-control none -k regex:device_kernel --launch-skip 2 --launch-count 1 $sec \
    $L --experts 64 --hidden 1024 --ffn 704 $one
  # shellcheck disable=SC2086
  run ncu_dw1_e1 ncu --clock-control none -k regex:device_kernel --launch-skip 2 --launch-count 1 $sec \
    $L --experts 1 --hidden 1024 --ffn 45056 $one
}
stage_trainovor() {  # rdep with --timing overlapped, without and with --owner-reduce (after trainov: TorchTitan's runs there)
  pip_wheels
  train_ro train_w1_overlapped_rdep2 rdep --timing overlapped
  train_ro train_w1_overlapped_rdep_or rdep --timing overlapped --owner-reduce
}
stage_windows() {
  local w=${WIN_W:-4}
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  run check_windows_w$w "$RDEP" check --backend cuda --ranks "$w" --gpus "$w" --json "$R/check_windows_w$w.json"
  for round in a b; do
    for mode in win 3ph; do
      local flag=()
      [ "$mode" = 3ph ] && flag=(--no-source-windows)
      run dispatch_w${w}_${mode}_$round "$RDEP" bench dispatch --ranks "$w" "${moon[@]}" "${flag[@]}" --json "$R/dispatch_w${w}_${mode}_$round.json"
    done
  done
  for mode in win 3ph; do
    local flag=()
    [ "$mode" = 3ph ] && flag=(--no-source-windows)
    run dispatch_zipf1_w${w}_$mode "$RDEP" bench dispatch --ranks "$w" "${moon[@]}" --routing zipf:1 "${flag[@]}" \
      --json "$R/dispatch_zipf1_w${w}_$mode.json"
    run dispatch_dsv3_w${w}_$mode "$RDEP" bench dispatch --ranks "$w" --tokens 4096 --hidden 7168 --experts 256 --topk 8 --warmup 20 \
      --iters 100 "${flag[@]}" --json "$R/dispatch_dsv3_w${w}_$mode.json"
  done
  layer windows_w$w "$w" 0
  run layer_windows_w${w}_3ph "$RDEP" bench layer --ranks "$w" --expert-compute cutlass --no-source-windows \
    --json "$R/layer_windows_w${w}_3ph.json" --baseline-json "$R/torch_windows_w$w.json"
}
stage_pdl() {  # programmatic dependent launch (RDEP_PDL on, the default, against off), alternated a/b: dispatch at W = 2
  # (a 2-GPU machine; PDL_W) and W = 1, the W = 1 layer (CUTLASS), DeepSeek-V3's dispatch at W = PDL_W
  local w=${PDL_W:-2}
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  for round in a b; do
    for mode in on off; do
      run dispatch_w${w}_pdl${mode}_$round env RDEP_PDL=$mode "$RDEP" bench dispatch --ranks "$w" "${moon[@]}" --no-nccl \
        --json "$R/dispatch_w${w}_pdl${mode}_$round.json"
      run dispatch_w1_pdl${mode}_$round env RDEP_PDL=$mode "$RDEP" bench dispatch --ranks 1 "${moon[@]}" --no-nccl --no-floor \
        --json "$R/dispatch_w1_pdl${mode}_$round.json"
      run layer_w1_pdl${mode}_$round env RDEP_PDL=$mode "$RDEP" bench layer --ranks 1 --expert-compute cutlass \
        --json "$R/layer_w1_pdl${mode}_$round.json"
    done
  done
  for mode in on off; do
    run dispatch_dsv3_w${w}_pdl$mode env RDEP_PDL=$mode "$RDEP" bench dispatch --ranks "$w" --tokens 4096 --hidden 7168 \
      --experts 256 --topk 8 --warmup 20 --iters 100 --no-nccl --json "$R/dispatch_dsv3_w${w}_pdl$mode.json"
  done
  # RDEP_PDL=yes refused: passes when rdep check fails and names the variable
  run pdl_bad_value bash -c 'out=$(env RDEP_PDL=yes "$0" check --backend cuda --ranks 1 2>&1); rc=$?; echo "$out"; echo "rc=$rc"
    [ $rc -ne 0 ] && grep -q "RDEP_PDL=" <<<"$out"' "$RDEP"
}
stage_inplace1() {  # the W = 1 combine in place (RDEP_W1_RETURN=in-place, the default) against the copy, alternated a/b
  local moon=(--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200)
  for mode in in-place copy; do
    run inplace_check_$mode env RDEP_W1_RETURN=$mode "$RDEP" check --backend cuda --ranks 1
  done
  for round in a b; do
    for mode in in-place copy; do
      run layer_w1_${mode}_$round env RDEP_W1_RETURN=$mode "$RDEP" bench layer --ranks 1 --expert-compute cutlass \
        --json "$R/layer_w1_${mode}_$round.json"
      run layer_w1_bf16_${mode}_$round env RDEP_W1_RETURN=$mode "$RDEP" bench layer --ranks 1 --expert-compute cutlass --grads bf16 \
        --json "$R/layer_w1_bf16_${mode}_$round.json"
      run dispatch_w1_${mode}_$round env RDEP_W1_RETURN=$mode "$RDEP" bench dispatch --ranks 1 "${moon[@]}" --no-nccl --no-floor \
        --json "$R/dispatch_w1_${mode}_$round.json"
    done
  done
  for mode in in-place copy; do
    run layer_w1_cublaslt_$mode env RDEP_W1_RETURN=$mode "$RDEP" bench layer --ranks 1 --expert-compute cublaslt \
      --json "$R/layer_w1_cublaslt_$mode.json"
  done
}
stage_clocks1() {
  nvidia-smi dmon -s pc -o T >"$R/clocks1_dmon.log" 2>&1 &
  local dmon=$!
  (sleep 12; nvidia-smi -q -d PERFORMANCE,CLOCK,POWER >"$R/clocks1_query.log" 2>&1) &
  run clocks1_gemm "$RDEP" bench gemm --path cutlass,cutlass --grads bf16 --mu 1536,3072 --iters 200 --warmup 20 \
    --json "$R/clocks1_gemm.json"
  kill "$dmon" 2>/dev/null
  wait
  tar czf "$OUT/receipts_w4.tgz" -C "$R" .
}
[ $# -gt 0 ] || set -- transport combine nodes layer skew dsv3 train
for stage in "$@"; do
  declare -F "stage_$stage" >/dev/null || { echo "receipts_w4: unknown stage $stage" | tee -a "$LOG"; exit 2; }
  echo "== stage $stage" >>"$LOG"
  "stage_$stage"
done
{
  echo "== receipts_w4: stages $*, $fails failed commands"
  nvidia-smi --query-gpu=index,name --format=csv,noheader | head -4
  nvidia-smi topo -m 2>/dev/null | head -5
} >>"$LOG"
cat "$LOG"
[ "$fails" -eq 0 ]
