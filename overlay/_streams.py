"""Closing a libp2p stream without caring how it went (the peer may be gone already)."""

from __future__ import annotations

from contextlib import suppress

from libp2p.abc import INetStream

__all__ = ["close_quietly", "reset_quietly"]


async def reset_quietly(stream: INetStream) -> None:
    with suppress(Exception):
        await stream.reset()


async def close_quietly(stream: INetStream) -> None:
    with suppress(Exception):
        await stream.close()
