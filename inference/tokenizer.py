"""A model folder's tokenizer without transformers: ``tokenizers`` plus the chat template.

Contract: ``LightTokenizer.from_folder(folder)`` reads ``tokenizer.json`` (the fast tokenizer
transformers itself runs), the chat template (``chat_template.jinja`` or ``tokenizer_config.json``)
and the special tokens named in ``tokenizer_config.json``. It answers the calls the engine
front makes of a transformers tokenizer (``encode``, ``decode``, ``apply_chat_template`` with
``tokenize=False``, ``get_vocab``) with the same results for the folders ``load_model`` writes
(checked against transformers in tests/inference/test_emulated.py), so an emulated node
tokenizes as a real one and computes the same model id, at a fraction of the memory (no
transformers, no torch). The template renders as transformers renders it: a sandboxed jinja2
environment with ``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now`` and a ``tojson`` that does not escape HTML.

A BPE model is built from the file's vocabulary and merges as Python objects (``_read_json``),
not by ``Tokenizer.from_file``: the same tokenizer (its ``to_str()`` is identical), but
``tokenizers``' own JSON path keeps the file's vocabulary and merges in two intermediate trees of
small allocations interleaved with the strings it keeps, and the freed nodes pin ~20 MB of
half-used heap pages per 262k-token vocabulary that ``malloc_trim`` cannot return. Built from
Python objects, its kept strings and tables are allocated in runs and the Python garbage goes
back in 1 MB arenas, all but a few that small objects made meanwhile keep (5-14 MB in a light
node; docs/models.md has the figures).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from itertools import repeat
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.models import BPE

from p2pnode.errors import P2PNodeError


class TokenizerLoadError(P2PNodeError, ValueError):
    """The folder's tokenizer files are missing or unreadable; the message names the file."""

    reason = "tokenizer_load_failed"


_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        value = value.get("content")
    return value if isinstance(value, str) else None


class LightTokenizer:
    """See the module contract."""

    def __init__(
        self, tokenizer: Tokenizer, chat_template: str | None, special: Mapping[str, str]
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special = dict(special)
        self._template: Any = None
        eos = self.special.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(eos) if eos else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> LightTokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            tok = _read_json(path)
        except Exception as exc:  # tokenizers raises its own Exception type for bad files
            raise TokenizerLoadError(f"cannot read {path}: {exc}") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except ValueError as exc:
                raise TokenizerLoadError(f"{config_path} is not JSON: {exc}") from None
        template = config.get("chat_template")
        template_path = folder / "chat_template.jinja"
        if template_path.is_file():
            template = template_path.read_text()
        special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        return cls(tok, template if isinstance(template, str) else None, special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        if self.chat_template is None:
            raise TokenizerLoadError("this model folder has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **self.special,
            **extra,
        )
        return self.encode(text) if tokenize else text


# The options of a BPE model in ``tokenizer.json`` that ``tokenizers.models.BPE`` takes as such.
_BPE_OPTIONS = (
    "dropout",
    "unk_token",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "fuse_unk",
    "byte_fallback",
    "ignore_merges",
)


def _read_json(path: Path) -> Tokenizer:
    """``Tokenizer.from_file(path)``, with a BPE model built from Python objects (see the module
    docstring); any file this does not know to build exactly goes to ``from_file`` itself.
    The merges are checked and turned into pairs by ``set``/``map`` in C, one pass each."""
    _utf8_of_shared_chars()
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return Tokenizer.from_file(str(path))
    vocab, merges = model.pop("vocab", None), model.pop("merges", None)
    added = spec.get("added_tokens") or []
    kinds = set(map(type, merges)) if isinstance(merges, list) else {None}
    if (
        set(model) - {"type", *_BPE_OPTIONS}
        or not isinstance(vocab, dict)
        or kinds not in ({list}, {str}, set())
        # The added tokens take their ids from the model when the file is read: built here
        # with a stand-in model, they must be in the vocabulary at the ids the file gives.
        or any(vocab.get(t.get("content")) != t.get("id") for t in added)
    ):
        return Tokenizer.from_file(str(path))
    # Pairs ["a", "b"], or "a b" in older files; anything but two strings makes BPE refuse.
    pairs = list(map(tuple, merges if kinds != {str} else map(str.split, merges, repeat(" "))))
    del merges
    unk = model.get("unk_token")
    stand_in = {t["content"]: t["id"] for t in added} | ({unk: vocab[unk]} if unk in vocab else {})
    spec["model"] = {**model, "vocab": stand_in, "merges": []}
    tok = Tokenizer.from_str(json.dumps(spec))
    del spec
    options = {k: model[k] for k in _BPE_OPTIONS if model.get(k) is not None}
    try:
        tok.model = BPE(vocab=vocab, merges=pairs, **options)
    except Exception:  # a bad entry: tokenizers' own reading names it
        return Tokenizer.from_file(str(path))
    return tok


def _utf8_of_shared_chars() -> None:
    """Have Python make, now, the UTF-8 copies it keeps of its shared one-character strings
    U+0080..U+00FF once Rust reads them (a vocabulary holds most of them). Made during a parse,
    ~120 such 3-byte copies land among the millions of temporary objects and each keeps a
    16 KB block of Python memory, and its 1 MB arena, from being freed: 5 MB of Gemma's."""
    BPE(vocab={chr(c): c for c in range(128, 256)}, merges=[])


def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
