"""The CPU kernel stack behind the ``Backend`` seam: C decode and prefill kernels
(``kernels.c``, built on first use by ``kernels.py``), the one-call forward (``fastpath.py``), the
prefill GEMM choice (``gemm.py``), KV slabs (``kvslab.py``), attention (``attention.py``) and huge
pages (``hugepages.py``). Private: the engine reaches it through ``_backend.py``.
"""
