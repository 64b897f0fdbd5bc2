"""The light tokenizer's reading of ``tokenizer.json`` (inference/tokenizer.py): a BPE model built
from Python objects is the very tokenizer ``tokenizers`` reads from the file (same ``to_str()``,
same encodings), for the default model and for BPE options and merge formats it does not use;
files it cannot build exactly go to ``Tokenizer.from_file`` itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from p2pnode.inference import tokenizer as light_tokenizer
from p2pnode.inference.models import load_light_model

TEXTS = [
    "Hello, world!",
    "  spaces  and\ttabs\n",
    "émigré naïve — ünïcödé 数学 🙂",
    "abcabc zz",
    "",
]


class _FromFileRefused:
    """Stands in for ``Tokenizer`` where a test requires the file be built, not read whole."""

    from_str = staticmethod(Tokenizer.from_str)

    @staticmethod
    def from_file(path: str) -> Tokenizer:
        raise AssertionError(f"{path} went to Tokenizer.from_file")


def _same_as_from_file(path: Path) -> Tokenizer:
    ours = light_tokenizer._read_json(path)
    theirs = Tokenizer.from_file(str(path))
    assert ours.to_str() == theirs.to_str()
    for text in TEXTS:
        assert ours.encode(text).ids == theirs.encode(text).ids
    return ours


def _toy_bpe(path: Path, **options: object) -> Path:
    """A small BPE tokenizer with byte fallback, an unknown token and special tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "c": 5, "ab": 6, "abc": 7, "z": 8}
    vocab |= {f"<0x{b:02X}>": 9 + b for b in range(256)}
    merges = [("a", "b"), ("ab", "c")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", **options))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path))
    return path


def test_the_default_models_tokenizer_is_built_not_read_whole(monkeypatch) -> None:
    path = load_light_model().path / "tokenizer.json"
    monkeypatch.setattr(light_tokenizer, "Tokenizer", _FromFileRefused)
    ours = light_tokenizer._read_json(path)
    monkeypatch.undo()
    theirs = Tokenizer.from_file(str(path))
    assert ours.to_str() == theirs.to_str()
    for text in TEXTS:
        assert ours.encode(text).ids == theirs.encode(text).ids
        assert ours.decode(theirs.encode(text).ids) == theirs.decode(theirs.encode(text).ids)


@pytest.mark.parametrize(
    "options", [{}, {"byte_fallback": True, "fuse_unk": True}, {"ignore_merges": True}]
)
def test_bpe_options_and_the_older_merge_format_build_the_same_tokenizer(
    tmp_path: Path, monkeypatch, options: dict
) -> None:
    path = _toy_bpe(tmp_path / "tokenizer.json", **options)
    legacy = json.loads(path.read_text())
    legacy["model"]["merges"] = [" ".join(pair) for pair in legacy["model"]["merges"]]
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    monkeypatch.setattr(light_tokenizer, "Tokenizer", _FromFileRefused)
    built = [light_tokenizer._read_json(p) for p in (path, tmp_path / "legacy.json")]
    monkeypatch.undo()
    for ours in built:
        theirs = Tokenizer.from_file(str(path))
        assert ours.to_str() == theirs.to_str()
        assert [ours.encode(t).ids for t in TEXTS] == [theirs.encode(t).ids for t in TEXTS]


def test_what_it_cannot_build_exactly_is_read_by_tokenizers(tmp_path: Path) -> None:
    # An added token outside the vocabulary takes its id from tokenizers' own rule.
    path = _toy_bpe(tmp_path / "added.json")
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<extra>"])
    tok.save(str(path))
    assert "<extra>" not in json.loads(path.read_text())["model"]["vocab"]
    _same_as_from_file(path)
    # Not a BPE model.
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.save(str(tmp_path / "wordlevel.json"))
    _same_as_from_file(tmp_path / "wordlevel.json")
    # A merge of three parts: tokenizers' own error names it.
    bad = json.loads(_toy_bpe(tmp_path / "bad.json").read_text())
    bad["model"]["merges"].append(["a", "b", "c"])
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(Exception) as theirs:
        Tokenizer.from_file(str(tmp_path / "bad.json"))
    with pytest.raises(Exception) as ours:
        light_tokenizer._read_json(tmp_path / "bad.json")
    assert str(ours.value) == str(theirs.value)
