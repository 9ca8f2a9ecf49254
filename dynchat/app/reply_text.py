"""A reply's text grown a round at a time, and which pieces of it the draft wrote.

Decoding the whole reply every round costs O(n^2) over a reply. Here a round decodes a short window
(as vLLM's detokenizer does: the text of ids[prefix:] minus the text of ids[prefix:read]), so a round
costs the same at token 10 and token 1,000; a character split across tokens waits until it is whole.
finish() checks the result against one full decode, so the logged reply is exactly the tokenizer's.
"""
from __future__ import annotations

from collections.abc import Callable

PARTIAL = "\ufffd"       # what a decode shows for a character whose bytes have not all arrived


class ReplyText:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self.segments: list[tuple[str, str]] = []      # (text, "draft" | "target"), joined they are the text
        self._prefix = 0         # window start: the text of ids[_prefix:_read] is the end of self.text
        self._read = 0           # tokens whose text is in self.text

    def add(self, ids: list[int], from_draft: int) -> None:
        """A round's tokens, the first `from_draft` of them accepted draft tokens."""
        start = len(self.ids)
        self.ids.extend(ids)
        for upto, label in ((start + from_draft, "draft"), (len(self.ids), "target")):
            if upto <= self._read:
                continue
            before = self.decode(self.ids[self._prefix:self._read])
            after = self.decode(self.ids[self._prefix:upto])
            if after.endswith(PARTIAL):
                continue                       # held back: it joins the next piece
            if after.startswith(before):
                self._append(after[len(before):], label)
            else:                              # the tokenizer rewrote text across the window's edge
                self._replace(self.decode(self.ids[:upto]), label)
            self._prefix, self._read = self._read, upto

    def finish(self) -> str:
        """The reply as one decode of all its tokens gives it (a partial last character dropped)."""
        full = self.decode(self.ids).rstrip(PARTIAL)
        if full != self.text:
            self._replace(full, "target")
        return self.text

    def _append(self, piece: str, label: str) -> None:
        if not piece:
            return
        self.text += piece
        if self.segments and self.segments[-1][1] == label:
            self.segments[-1] = (self.segments[-1][0] + piece, label)
        else:
            self.segments.append((piece, label))

    def _replace(self, text: str, label: str) -> None:
        """Set the text, keeping the segments of the part that did not change."""
        keep = 0
        while keep < min(len(text), len(self.text)) and text[keep] == self.text[keep]:
            keep += 1
        segments, total = [], 0
        for piece, lab in self.segments:
            if total + len(piece) > keep:
                piece = piece[:keep - total]
            if piece:
                segments.append((piece, lab))
            total += len(piece)
            if total >= keep:
                break
        self.segments, self.text = segments, text[:keep]
        self._append(text[keep:], label)
