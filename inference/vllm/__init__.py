"""The optional vLLM engine (``engine.py``), its KV-cache events (``events.py``) and the
version shims it needs (``compat.py``). Loaded only when a node is started with ``--engine vllm``.
"""
