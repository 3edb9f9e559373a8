"""rdu: the decode step as a dataflow graph, mapped onto a modeled SambaNova SN40L and onto a GPU model.

Data flows one way: trace (jaxpr -> graph) -> graph -> mapping (kernels, stages, allocation, memory)
-> simulate (SN40L time per token) and gpu (every GPU mode) -> analysis, validate, viz/plots (reports).
hardware holds the specs and their free constants, anchors the measured and published rows, fit/ the
optax fit of the free constants (`python -m rdu.fit`), cli the `jaxdecode rdu` subcommand.
"""
