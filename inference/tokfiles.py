"""A model's tokenizer files and the model id that binds them (no torch, no transformers).

Contract:
- ``TOKENIZER_FILES``: the files of a model folder that say how it turns text into tokens and
  back (the fast tokenizer, its config and special tokens, the chat template) and the sizes a
  node without weights needs (``config.json``, ``generation_config.json``). A light node fetches
  exactly these from a serving peer (``overlay/serve/tokenizers.py``).
- ``read_tokenizer_files(folder)`` -> ``{name: bytes}`` of those present (``tokenizer.json``
  and ``config.json`` must be).
- ``files_digest(files)``: sha256 over the sorted names and bytes.
- ``compute_model_id(name, files, weights, note="")`` -> ``<name>@<16 hex>``: sha256 of the
  name, ``files_digest(files)``, the weights digest and ``note`` (the compute dtype when it is
  not the stored one: other numerics, other cache contents). Two nodes share an id exactly when
  they tokenize, template and compute alike; a light node given the files, the weights digest
  and the note checks them against an id it already knows (``check_model_id``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)
REQUIRED_FILES = ("tokenizer.json", "config.json")
MAX_FILES_BYTES = 64 << 20  # a 262k-vocabulary tokenizer.json is ~33 MB


def read_tokenizer_files(folder: Path) -> dict[str, bytes]:
    files = {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
    missing = [n for n in REQUIRED_FILES if n not in files]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {', '.join(missing)}")
    return files


def files_digest(files: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def compute_model_id(name: str, files: Mapping[str, bytes], weights: str, note: str = "") -> str:
    text = f"{name}\n{files_digest(files)}\n{weights}" + (f"\n{note}" if note else "")
    return f"{name}@{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def check_model_id(model_id: str, files: Mapping[str, bytes], weights: str, note: str) -> bool:
    """The files (with that weights digest and note) are the ones ``model_id`` was made of."""
    name = model_id.rsplit("@", 1)[0]
    if set(files) - set(TOKENIZER_FILES) or any(n not in files for n in REQUIRED_FILES):
        return False
    return compute_model_id(name, files, weights, note) == model_id
