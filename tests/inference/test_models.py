"""The model id binds the weights (inference/models.py): different weights never share an id,
and the weights' digest is cached next to them so a restart does not re-read them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from p2pnode.inference.models import ModelLoadError, compute_model_id, weights_digest


@pytest.fixture(scope="module")
def tokenizer():
    from p2pnode.inference.models import default_model_path
    from p2pnode.inference.tokfiles import read_tokenizer_files

    return read_tokenizer_files(default_model_path())


def _folder(root: Path, name: str, weights: bytes) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text("{}")
    return folder


def test_same_name_and_tokenizer_with_other_weights_get_other_ids(tmp_path, tokenizer) -> None:
    a = _folder(tmp_path / "a", "my-finetune", b"weights of one fine-tune")
    b = _folder(tmp_path / "b", "my-finetune", b"weights of another one!!")
    c = _folder(tmp_path / "c", "my-finetune", b"weights of one fine-tune")
    ids = [compute_model_id("my-finetune", tokenizer, weights_digest(f)) for f in (a, b, c)]
    assert ids[0] != ids[1] and ids[0] == ids[2]
    assert all(i.startswith("my-finetune@") for i in ids)
    empty = tmp_path / "e"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weight files"):
        weights_digest(empty)


def test_the_digest_is_cached_and_a_changed_file_invalidates_it(tmp_path) -> None:
    folder = _folder(tmp_path, "m", b"x" * 1000)
    first = weights_digest(folder)
    cache = folder / "p2pnode-weights.json"
    data = json.loads(cache.read_text())
    data["sha256"] = "cached-value"
    cache.write_text(json.dumps(data))
    assert weights_digest(folder) == "cached-value"  # the weights were not read again
    weights = folder / "model.safetensors"
    weights.write_bytes(b"y" * 1000)  # same size, new bytes: the mtime changes
    os.utime(weights, ns=(1, 1))
    assert weights_digest(folder) not in (first, "cached-value")


def test_an_unwritable_model_folder_caches_in_the_cache_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("P2PNODE_CACHE", str(tmp_path / "cache"))
    folder = _folder(tmp_path, "ro", b"z" * 100)
    (folder / "p2pnode-weights.json").mkdir()  # cannot be written, even by root
    digest = weights_digest(folder)
    cached = list((tmp_path / "cache" / "weights").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["sha256"] == digest
    assert weights_digest(folder) == digest
