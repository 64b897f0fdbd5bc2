"""What the model loader and the CPU kernel stack both read: the Llama layer names and the
cache folder.

Its own module so that the kernel stack (``_cpu/``) never imports the model loader: the loader
installs the kernels on a model it loads (``models.load_model``), so the two importing each
other would be a circle. ``models.py`` re-exports both names, where the rest of the package
finds them.
"""

from __future__ import annotations

import os
from pathlib import Path

# The linear layers of one Llama decoder layer, grouped by the input they read (q/k/v the
# attention input, gate/up the MLP input): GPTQ quantizes a group on one set of statistics;
# the quantized draft and the C decoder stack walk them flat, in this order.
LLAMA_LINEAR_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
LLAMA_LINEARS = tuple(name for group in LLAMA_LINEAR_GROUPS for name in group)


def cache_dir() -> Path:
    """Where converted models and compiled kernels live: ``$P2PNODE_CACHE`` or
    ``~/.cache/p2pnode``."""
    root = os.environ.get("P2PNODE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "p2pnode"
