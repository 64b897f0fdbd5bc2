"""Tokenizer files over the overlay (overlay/serve/tokenizers.py) between real overlay nodes:
a light node gets the files the model id was made of, and nothing else passes for them."""

from __future__ import annotations

import shutil

import pytest

from p2pnode.inference.models import load_light_model, tokenizer_model
from p2pnode.inference.tokfiles import read_tokenizer_files
from p2pnode.overlay.serve.tokenizers import (
    TOKENIZER_PROTOCOL,
    ServedFiles,
    TokenizerFetchFailed,
    TokenizerServer,
    cached_tokenizer,
    fetch_tokenizer,
)

from testkit.cluster import overlay_nodes


@pytest.fixture(scope="module")
def smol():
    return load_light_model()  # the default model's folder, tokenizer only


async def test_a_fetched_tokenizer_matches_the_id_and_tokenizes_alike(tmp_path, smol) -> None:
    async with overlay_nodes(2) as (_keys, (server, light)):
        served = {smol.model_id: ServedFiles(smol.path, smol.weights, "")}
        handler = TokenizerServer(lambda: served)
        server.set_stream_handler(TOKENIZER_PROTOCOL, handler.handle)
        folder = tmp_path / "tok"
        await fetch_tokenizer(light, server.peer_id, smol.model_id, folder)
        assert read_tokenizer_files(folder) == read_tokenizer_files(smol.path)
        assert cached_tokenizer(folder, smol.model_id) == folder
        got = tokenizer_model(folder, smol.name, smol.model_id)
        text = "Hello, swarm: émigré 数学 🙂"
        assert got.tokenizer.encode(text) == smol.tokenizer.encode(text)
        chat = [{"role": "user", "content": "hi"}]
        assert got.tokenizer.apply_chat_template(chat, tokenize=False) == (
            smol.tokenizer.apply_chat_template(chat, tokenize=False)
        )
        assert (got.vocab_size, got.context_length) == (smol.vocab_size, smol.context_length)

        with pytest.raises(TokenizerFetchFailed, match="no_model"):
            await fetch_tokenizer(light, server.peer_id, "other@0123456789abcdef", tmp_path / "x")


async def test_files_that_do_not_make_the_id_are_refused(tmp_path, smol) -> None:
    # A peer serving another chat template under the same id (same tokenizer, same weights).
    forged = tmp_path / "forged"
    shutil.copytree(smol.path, forged, ignore=shutil.ignore_patterns("*.safetensors"))
    config = forged / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|im_start|>", "<|im_start|> "))
    chat = forged / "chat_template.jinja"
    if chat.is_file():
        chat.write_text(chat.read_text() + "{{ 'injected' }}")
    async with overlay_nodes(2) as (_keys, (server, light)):
        served = {smol.model_id: ServedFiles(forged, smol.weights, "")}
        server.set_stream_handler(TOKENIZER_PROTOCOL, TokenizerServer(lambda: served).handle)
        folder = tmp_path / "tok"
        with pytest.raises(TokenizerFetchFailed, match="do not match"):
            await fetch_tokenizer(light, server.peer_id, smol.model_id, folder)
        assert not folder.exists()
    # A cached folder altered on disk is not taken either.
    good = tmp_path / "good"
    shutil.copytree(smol.path, good, ignore=shutil.ignore_patterns("*.safetensors"))
    assert cached_tokenizer(good, smol.model_id) is None  # no record of a checked fetch
