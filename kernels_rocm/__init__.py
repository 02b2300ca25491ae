"""Portable Triton kernels (ROCm and CUDA; CPU through TRITON_INTERPRET=1 for tests).

Imports only torch and triton. Modules: `kv_cache` (paged KV writes, MHA and MLA latent rows,
bf16 or fp8), `paged_attention` (MHA/GQA), `mla_decode` (absorbed MLA), `fused_moe` (bf16 routed
experts), `mxfp4_moe` / `mxfp4_linear` (MXFP4 experts and dense layers, activation QDQ fused),
`rms_norm` (RMSNorm, optionally fused with the residual add), `rope_kv_cache` (rotary embedding
fused with the KV write, MHA and MLA), `activation` (SiLU-and-mul), `skinny_gemm` (GEMV-style
GEMM for M <= 8, SwiGLU epilogue optional; model_ops.linear.dense takes it for decode-sized
products on NVIDIA), `mxfp4_moe_decode` (the MXFP4 MoE at a few tokens), `step_advance` (a
following step's inputs advanced on the device, and the draft's first inputs from a verification),
`greedy_verify` (a greedy step's verification in one launch), `_pdl` (programmatic dependent launch), and `aiter_ops` (the
adapters to aiter's MLA decode and MXFP4 fused MoE on ROCm; torch only, aiter imported lazily).
Import the module you need; nothing is imported here so that importing the package stays cheap.
"""
