"""Tokenizer files over the overlay: how a node without a model's weights gets its tokenizer.

Why: a light entry node routes a request by the block hashes of its tokens and turns answers
back into text, so it needs the model's tokenizer (a few MB; no weights, no torch). Any node
serving the model has the files the model id was made of (``inference/tokfiles.py``).

Protocol ``/p2pnode/tokenizer/1`` (one request per stream): the asker sends ``{"model_id"}``;
the server answers a header ``{"files": {name: size}, "weights", "note"}`` (or ``{"error"}``:
``no_model``, ``busy``), then each file in name order as frames ``{"data": bytes}`` of at most
``CHUNK`` bytes.

Contract:
- ``TokenizerServer(models)``: ``models()`` maps the model ids this node serves to their
  folder, weights digest and id note; ``handle(stream)`` serves one request, at most
  ``max_concurrent`` at a time (``busy`` beyond).
- ``fetch_tokenizer(node, peer, model_id, folder)`` asks ``peer``, checks the files against
  ``model_id`` (``check_model_id``: a peer cannot pass off another tokenizer or chat template
  under that id) and writes them to ``folder`` (atomically); ``TokenizerFetchFailed`` otherwise.
- ``cached_tokenizer(folder, model_id)``: a folder written by an earlier fetch, checked again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2pnode.errors import P2PNodeError
from p2pnode.inference.tokfiles import (
    MAX_FILES_BYTES,
    TOKENIZER_FILES,
    check_model_id,
    read_tokenizer_files,
)
from p2pnode.overlay import wire
from p2pnode.overlay.limits import remote_peer

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from p2pnode.overlay.seams import OverlayHost

log = logging.getLogger("p2pnode.overlay.serve.tokenizers")

TOKENIZER_PROTOCOL = "/p2pnode/tokenizer/1"
CHUNK = 512 * 1024
_ID_FILE = "p2pnode-model-id.json"


class TokenizerFetchFailed(P2PNodeError, RuntimeError):
    """A peer did not hand over a model's tokenizer files that match its id."""

    reason = "tokenizer_fetch_failed"


@dataclass(frozen=True)
class ServedFiles:
    folder: Path
    weights: str
    note: str


class TokenizerServer:
    """Serves the tokenizer files of the models this node runs (see the module contract)."""

    def __init__(
        self, models: Callable[[], Mapping[str, ServedFiles]], max_concurrent: int = 2
    ) -> None:
        self.models = models
        self.slots = trio.CapacityLimiter(max_concurrent)
        self.served = 0

    async def handle(self, stream: INetStream) -> None:
        limit = wire.limit_for(TOKENIZER_PROTOCOL)
        try:
            with trio.fail_after(30):
                req = await wire.read_frame(stream, limit=limit)
            model_id = req.get("model_id") if isinstance(req, dict) else None
            served = self.models().get(model_id) if isinstance(model_id, str) else None
            if served is None:
                await wire.write_frame(stream, {"error": "no_model"}, limit=limit)
                return
            try:
                self.slots.acquire_nowait()
            except trio.WouldBlock:
                await wire.write_frame(stream, {"error": "busy"}, limit=limit)
                return
            try:
                await self._send(stream, served, limit)
            finally:
                self.slots.release()
        except (wire.WireError, trio.TooSlowError, OSError) as exc:
            log.info("tokenizer request from %s failed: %s", remote_peer(stream), exc)
        except Exception as exc:  # a libp2p stream error of any type ends this request only
            log.info("tokenizer request from %s failed: %r", remote_peer(stream), exc)
        finally:
            with trio.move_on_after(1):
                await stream.close()

    async def _send(self, stream: INetStream, served: ServedFiles, limit: int) -> None:
        files = await trio.to_thread.run_sync(read_tokenizer_files, served.folder)
        header = {
            "files": {n: len(d) for n, d in files.items()},
            "weights": served.weights,
            "note": served.note,
        }
        with trio.fail_after(120):  # ~33 MB for a 262k vocabulary over a slow link
            await wire.write_frame(stream, header, limit=limit)
            for name in sorted(files):
                data = files[name]
                for at in range(0, max(1, len(data)), CHUNK):
                    await wire.write_frame(stream, {"data": data[at : at + CHUNK]}, limit=limit)
        self.served += 1


async def fetch_tokenizer(
    node: OverlayHost, peer: str, model_id: str, folder: Path, *, timeout_s: float = 120.0
) -> Path:
    limit = wire.limit_for(TOKENIZER_PROTOCOL)
    try:
        with trio.fail_after(timeout_s):
            stream = await node.open_stream(peer, TOKENIZER_PROTOCOL, timeout=timeout_s)
            try:
                await wire.write_frame(stream, {"model_id": model_id}, limit=limit)
                files, weights, note = await _receive(stream, limit)
            finally:
                with trio.move_on_after(1):
                    await stream.close()
    except TokenizerFetchFailed:
        raise
    except (trio.TooSlowError, wire.WireError, OSError, P2PNodeError) as exc:
        raise TokenizerFetchFailed(f"{peer}: {exc!r}") from None
    except Exception as exc:  # a libp2p stream error of any type: no files from this peer
        raise TokenizerFetchFailed(f"{peer}: {exc!r}") from None
    if not check_model_id(model_id, files, weights, note):
        raise TokenizerFetchFailed(f"{peer} sent tokenizer files that do not match {model_id}")
    await trio.to_thread.run_sync(_write, folder, files, model_id, weights, note)
    return folder


async def _receive(stream: INetStream, limit: int) -> tuple[dict[str, bytes], str, str]:
    header = await wire.read_frame(stream, limit=limit)
    if not isinstance(header, dict):
        raise TokenizerFetchFailed("no header")
    if "error" in header:
        raise TokenizerFetchFailed(f"the peer answered {header['error']!r}")
    sizes, weights, note = header.get("files"), header.get("weights"), header.get("note")
    if (
        not isinstance(sizes, dict)
        or not isinstance(weights, str)
        or not isinstance(note, str)
        or not all(n in TOKENIZER_FILES and isinstance(s, int) and s >= 0 for n, s in sizes.items())
        or sum(sizes.values()) > MAX_FILES_BYTES
    ):
        raise TokenizerFetchFailed(f"malformed header {str(header)[:200]}")
    files: dict[str, bytes] = {}
    for name in sorted(sizes):
        data = bytearray()
        while True:  # every file is at least one frame; a timeout bounds a stalling peer
            frame = await wire.read_frame(stream, limit=limit)
            chunk = frame.get("data") if isinstance(frame, dict) else None
            bad = not isinstance(chunk, bytes) or len(data) + len(chunk) > sizes[name]
            if bad or (not chunk and sizes[name] > 0):
                raise TokenizerFetchFailed(f"bad chunk of {name}")
            data += chunk
            if len(data) == sizes[name]:
                break
        files[name] = bytes(data)
    return files, weights, note


def _write(folder: Path, files: Mapping[str, bytes], model_id: str, weights: str, note: str):
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    meta = {"model_id": model_id, "weights": weights, "note": note}
    (tmp / _ID_FILE).write_text(json.dumps(meta))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def cached_tokenizer(folder: Path, model_id: str) -> Path | None:
    """``folder`` when an earlier fetch left the files of ``model_id`` there (checked again)."""
    try:
        meta = json.loads((folder / _ID_FILE).read_text())
        files = read_tokenizer_files(folder)
    except (OSError, ValueError):
        return None
    if meta.get("model_id") != model_id:
        return None
    ok = check_model_id(model_id, files, str(meta.get("weights")), str(meta.get("note")))
    return folder if ok else None
