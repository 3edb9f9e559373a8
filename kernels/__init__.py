"""Pallas GPU kernels for decode (FlashDecoding++): decode_attention/ (split-K attention: kernels,
split combine, layouts), flat_gemm, flat_gemm_stream, qkv_rope, rms_norm, allreduce (tensor parallel);
dispatch and tune pick and profile them, shapes names the test and benchmark shapes; tables/<gpu>.json
holds the profiled dispatch tables that dispatch reads.

No imports from jaxdecode or rdu. Each kernel module reads: kernel body, pallas_call / plgpu.kernel
wrapper, public jitted op, pure-jnp reference.
"""
