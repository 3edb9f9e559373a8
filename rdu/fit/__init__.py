"""The cost models of `rdu.simulate` and `rdu.gpu` as pure `jnp` functions, and an optax fit of their
few free constants.

Each decode-step time is a function of two things:

- **fixed inputs** (`RDUFeatures`, `GPUFeatures`, `InplaceFeatures`), read once from a traced graph
  and its mapping: per kernel, the calls and iterations per token, bytes per socket in HBM and DDR,
  the PCU stage time, the all-reduce time, the kernels XLA/eager launch per call; and the hardware
  bandwidths;
- **free constants** (a flat dict of floats, a pytree), the ones no source publishes:
  SN40L: `launch_s` (one kernel call), `sync_s` (synchronization at the end of a call),
  `stage_fill_drain_s` (pipeline drain + fill at a call boundary, per stage of the kernel's pipeline),
  `hbm_efficiency` (streaming bandwidth / peak HBM), `p2p_latency_s` (one all-reduce step);
  GPU: `kernel_overhead_s` (gap + launch per queued kernel), `eager_op_s` (host dispatch per op in
  eager mode), `gemv_efficiency` (matmul bandwidth / read ceiling at M = batch = 1),
  `gemm_efficiency` (the same at M >= 2) and `attention_efficiency` (KV-cache read / read ceiling).

`rdu_time` and `gpu_time` equal `simulate_rdu` and `simulate_gpu` (the numpy/Python reference) for the
published constants; tests/test_rdu_fit.py checks it. They are differentiable, so `fit_constants` runs
Adam (optax) on the constants, in log space (times) and logit space (efficiencies, kept in (0, 1)),
with loss = mean squared log error over the rows of one split plus a weak pull towards the published
value. launch + sync reach a per-token time only as a sum, so their split comes from that pull alone;
the per-stage fill/drain is told apart by the depth of each kernel (decoder ~55 stages, LM head 8).

Rows (rdu.anchors): GPU, our measured H200 step times (BENCHMARKS.md and h200-anchors.md),
Llama-3.1-8B shape, cache 1k and 8k; train on batch 1, hold out batch 8 and 32. Batch-1 rows carry no
information on `gemm_efficiency`, so it stays at its published value (cuBLAS, M = 1..128): the held-out
rows test that measurement, not a fit. `run_fit` also refits the model without the batch term
(gemm tied to gemv), as the baseline on the same rows. SN40L, the published Kernel Looping
numbers `rdu.validate` compares with (bounds "up to" / "over" taken as values); train on the
one-socket, 16-socket and geomean rows, hold out the 8-socket rows. One set of constants for all.

Our looped in-place engine ("ours", GPU mode "looped_inplace") has its own constants, fitted after
the "xla" ones (train/held-out split in rdu.anchors.INPLACE_ROWS, plus leave-one-out).

  common.py   the fit itself: constants in free (log/logit) space, Adam, the loss, error summaries
  sn40l.py    the SN40L model in jnp (`rdu_time`), its features and fit
  gpu.py      the GPU modes xla, eager, scan_copy, fixed in jnp (`gpu_time`), features and fit
  inplace.py  the looped_inplace mode in jnp (`inplace_time`), its fit and leave-one-out
  quant.py    the quantized rows of looped_inplace: one constant solved on one row, the rest held out
  run.py      all fits, the per-row table and the record of rdu/fitted.json

    python -m rdu.fit            # fit, print the table, write rdu/fitted.json
"""
