"""Pallas GPU kernels for decode (FlashDecoding++): decode_attention (its kernel bodies and pallas_call
wrapper in decode_attention_kernels), flat_gemm, flat_gemm_stream, rms_norm, allreduce (tensor parallel),
dispatch, tune, shapes; tables/<gpu>.json holds the profiled dispatch tables that dispatch reads.

No imports from jaxdecode or rdu. Each kernel module reads: kernel body, pallas_call / plgpu.kernel
wrapper, public jitted op, pure-jnp reference.
"""
