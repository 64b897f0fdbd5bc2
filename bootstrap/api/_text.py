"""Text assembly: token ids in, text deltas out, cut at the request's stop strings.

Contract:
- Text is detokenized incrementally and never splits a UTF-8 character; streamed deltas
  concatenate to exactly the text of the whole answer.
- ``stop`` strings end the answer and are not part of it: text that could still begin one is
  held back until it cannot. (Stop strings that are one token also stop the engine itself;
  ``_params.py`` finds those.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextAssembler:
    """Token ids in, text deltas out.

    Never emits part of a UTF-8 character (a window whose decoding ends in U+FFFD waits for
    more tokens) and never emits any part of a stop string: text that could still begin one is
    held back until it cannot. ``text`` is the answer so far (held text included);
    ``stopped`` turns True when a stop string was found (``text`` is cut before it).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stops = tuple(s for s in stops if s)
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix = 0  # tokens before this are fully turned into text
        self._read = 0  # tokens[_prefix:_read] decode to the last chunk of text added
        self._emitted = 0  # characters of ``text`` already handed out

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens.append(token)
        # Decode a window that starts a few tokens back so context-dependent decoding (leading
        # spaces, merged bytes) matches a decode of the whole sequence.
        prefix_text = self._decode(self.tokens[self._prefix : self._read])
        new_text = self._decode(self.tokens[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character, or a special token that decodes to nothing
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once no token will come."""
        if not self.stopped:
            full = self._decode(self.tokens)
            if full.startswith(self.text):
                self.text = full
            else:  # decoding is not prefix-stable here: add what the window still holds
                prefix_text = self._decode(self.tokens[self._prefix : self._read])
                self.text += self._decode(self.tokens[self._prefix :])[len(prefix_text) :]
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        safe = len(self.text)
        if self._stops and not self.stopped:
            hits = [i for s in self._stops if (i := self.text.find(s, self._emitted)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                safe = len(self.text)
            elif not final:
                safe -= self._held_suffix()
        out = self.text[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return out

    def _held_suffix(self) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
        tail = self.text[self._emitted :]
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best
