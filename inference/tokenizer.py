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
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

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
            tok = Tokenizer.from_file(str(path))
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
