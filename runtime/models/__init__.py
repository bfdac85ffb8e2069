"""Models: the Llama/Qwen2 decoder over the token-slot KV cache (decoder.py, layers.py), its
architecture (arch.py) and head split (heads.py), what a checkpoint says about itself
(checkpoint.py, no torch: the launcher reads it too), weight loading (weights.py) and
`loader.build_model`, which the worker calls. Import the modules; this package imports nothing."""
