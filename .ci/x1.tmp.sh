step kernels_coverage 150 record_coverage vllm/models/kimi_k3/nvidia/tests/test_specialized_steps_cuda.py
EXPECT=147 step decode_bench_tp8_mid 294 python3 -m vllm.models.kimi_k3.nvidia.benchmarks.decode_latency --out "$K3_EVIDENCE_DIR" --reps 30 --parity-steps 8 --name decode_bench_tp8_mid --tp 8 --rows 2 4 16 32 --q 1 --contexts 4096
EXPECT=133 step decode_bench_tp16_large 266 python3 -m vllm.models.kimi_k3.nvidia.benchmarks.decode_latency --out "$K3_EVIDENCE_DIR" --reps 30 --parity-steps 8 --name decode_bench_tp16_large --tp 16 --rows 32 64 --q 1 --contexts 4096
EXPECT=50 step profile_tp16 90 python3 -m vllm.models.kimi_k3.nvidia.benchmarks.profile_step --tp 16 --rows 1 8 --top 30 --out "$W/profile_tp16.json"
EXPECT=40 step moe_sweep 170 python3 -m vllm.models.kimi_k3.nvidia.benchmarks.sweep_moe_tiling --tps 16 --rows 2 8 --budget-s $((BUDGET - SECONDS - 30)) --out "$W/moe_sweep.json"
