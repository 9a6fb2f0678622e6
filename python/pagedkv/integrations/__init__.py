"""Drop-in integrations of pagedkv into other engines' schedulers (``pagedkv.integrations.vllm``).

Each subpackage imports its engine only when imported itself: ``import pagedkv`` never needs one.
"""
