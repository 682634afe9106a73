"""What a resumable stream keeps of itself while it is relayed (``KeptStream``): the
engine's bytes so far, for the ``Resume`` hook to read what was generated if the stream is
cut, those of a long stream folded (handed to ``Fold``) so that memory stays bounded.
``pdproxy.proxying.resumable`` holds one per stream until it is cut or can no longer
migrate."""

from __future__ import annotations

from collections.abc import Callable

FOLD_BYTES = 256 * 1024  # a resumable stream's kept bytes past this are folded (parsed)

# Takes whole events of a long stream's kept bytes (so they need not be kept); False when
# they show the stream cannot be continued.
Fold = Callable[[bytes], bool]


class KeptStream:
    """A resumable stream's kept bytes (a reference per chunk) and its fold."""

    __slots__ = ("fold", "kept", "last", "size")

    def __init__(self, fold: Fold) -> None:
        self.fold = fold
        self.kept: list[bytes] = []
        self.size = 0
        self.last = b""  # the last byte kept: an event's end may span two chunks

    def keep(self, chunk: bytes) -> bool:
        """Keep ``chunk``; False when a fold refused the kept bytes: the stream can no
        longer migrate."""
        self.kept.append(chunk)
        self.size += len(chunk)
        last, self.last = self.last, chunk[-1:]
        # Folded only when this chunk may end an event: an endless event is never
        # joined again per chunk (that was quadratic: 28.6 s of CPU for 128 MiB).
        if self.size > FOLD_BYTES and (b"\n\n" in chunk or (chunk[:1] == b"\n" and last == b"\n")):
            return self._fold()
        return True

    def _fold(self) -> bool:
        """Hand the kept bytes' whole events to the fold; keep the rest of the last one."""
        data = b"".join(self.kept)
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            return True
        if not self.fold(data[:end]):
            return False
        rest = data[end:]
        self.kept = [rest] if rest else []
        self.size = len(rest)
        return True

    def delivered(self) -> bytes:
        """The engine's bytes kept so far (since the last fold)."""
        return b"".join(self.kept)
