"""Other frameworks driving the library: the lm-evaluation-harness model (`lm_eval_harness`) and the vLLM
KV connector (`vllm_connector`, an optional extra). Imports `core` and `evaluation`; nothing in the package imports
these modules.
"""
