"""The deterministic model: tokenizer, KV per token, and decode as a function of the KV.

Each prompt token's KV entry is a digest chained over the previous entry, so the last entry
stands for the whole prefix. Decode continues the chain from the KV it holds: a decode that
was handed another request's KV produces different words.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator, Sequence

KV_BYTES_PER_TOKEN = 32
_SEED = b"pdproxy-sim-kv-v1"
_WORD_RE = re.compile(r"\w+|[^\w\s]")

_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu red orange "
    "yellow green blue indigo violet amber black white silver gold copper iron stone river "
    "mountain valley forest desert ocean island harbor bridge tower garden meadow canyon glacier "
    "thunder rain snow wind cloud storm sun moon star comet planet orbit rocket engine signal "
    "packet socket stream buffer kernel thread cache block token prefill decode proxy"
)
VOCAB: tuple[str, ...] = tuple(_WORDS.split())


@functools.lru_cache(maxsize=65536)  # a pure function; the cache only saves hashing
def token_id(word: str) -> int:
    """A stable id for one word (not Python's salted hash)."""
    digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def tokenize(text: str) -> list[int]:
    """Split into words and punctuation; each piece is one token."""
    return [token_id(w) for w in _WORD_RE.findall(text)]


def words(text: str) -> list[str]:
    """The pieces ``tokenize`` makes of ``text`` (vLLM's ``token_strs``)."""
    return _WORD_RE.findall(text)


_VOCAB_IDS: tuple[int, ...] = tuple(token_id(w) for w in VOCAB)


# The ids are hashes, so detokenizing needs the words back: the generated vocabulary, and
# every word /tokenize has seen in this process, shared by all its sims as real instances
# share their tokenizer files. Bounded; a word seen past the bound stays unknown.
_KNOWN_MAX = 1 << 16
_KNOWN: dict[int, str] = {token_id(w): w for w in VOCAB}
_VOCAB_IDS: tuple[int, ...] = tuple(token_id(w) for w in VOCAB)


def remember(pieces: Sequence[str]) -> list[int]:
    """The ids of ``pieces`` (from ``words``), remembered for ``detokenize``."""
    ids = [token_id(w) for w in pieces]
    for tok, word in zip(ids, pieces, strict=True):
        if len(_KNOWN) < _KNOWN_MAX:
            _KNOWN.setdefault(tok, word)
    return ids


def detokenize(ids: Sequence[int]) -> str:
    """The text of ``ids``: words spaced, punctuation attached. Raises ``KeyError`` (the
    id) for an id no word known here has."""
    text = ""
    for tok in ids:
        if tok not in _KNOWN:
            raise KeyError(tok)
        word = _KNOWN[tok]
        text += f" {word}" if text and (word[0].isalnum() or word[0] == "_") else word
    return text


def _step(prev: bytes, tok: int) -> bytes:
    return hashlib.blake2b(prev + tok.to_bytes(4, "big"), digest_size=KV_BYTES_PER_TOKEN).digest()


DEFAULT_MODEL = "sim-model"


@functools.lru_cache(maxsize=1024)
def seed(served: str) -> bytes:
    """The KV chain's start for one served model or adapter: each runs its own weights,
    so the same prompt leaves different KV (and words) on each. The default model keeps
    the original seed."""
    if served == DEFAULT_MODEL:
        return _SEED
    return hashlib.blake2b(_SEED + served.encode(), digest_size=KV_BYTES_PER_TOKEN).digest()


def kv_is_for(served: str, first_token: int, first_entry: bytes) -> bool:
    """Whether a KV chain's first entry was computed by ``served``'s weights."""
    return _step(seed(served), first_token) == first_entry


def extend_kv(
    kv: list[bytes], tokens: Sequence[int], start: int, served: str = DEFAULT_MODEL
) -> list[bytes]:
    """Compute KV entries for tokens[start:], chained after kv[start-1] (or ``served``'s
    seed); mutates and returns kv."""
    prev = kv[start - 1] if start > 0 else seed(served)
    del kv[start:]
    for tok in tokens[start:]:
        prev = _step(prev, tok)
        kv.append(prev)
    return kv


def compute_kv(tokens: Sequence[int], served: str = DEFAULT_MODEL) -> list[bytes]:
    return extend_kv([], tokens, 0, served)


def decode_words(last_kv: bytes) -> Iterator[str]:
    """The endless stream of generated words after a prompt whose last KV entry is last_kv.

    Autoregressive: the state after a word is that word's KV entry chained on the context
    (``_step``), the one a prompt ending in that word has, so a prompt extended by the first k
    generated tokens decodes exactly the rest of the uninterrupted answer (a migrated stream's
    continuation; a decode given prompt + [the prefill's first word] goes on with the second).
    """
    state = last_kv
    n = len(VOCAB)
    while True:
        i = int.from_bytes(state[:4], "big") % n
        yield VOCAB[i]
        state = _step(state, _VOCAB_IDS[i])


def pack_blocks(kv: Sequence[bytes], block_size: int) -> list[bytes]:
    """Group per-token KV entries into blocks of block_size tokens (the last may be partial)."""
    return [b"".join(kv[i : i + block_size]) for i in range(0, len(kv), block_size)]


def unpack_blocks(blocks: Sequence[bytes]) -> list[bytes]:
    data = b"".join(blocks)
    n = KV_BYTES_PER_TOKEN
    return [data[i : i + n] for i in range(0, len(data) - len(data) % n, n)]


ASSISTANT_OPENER = "<|im_start|>assistant\n"


def render_chat(
    messages: Sequence[dict[str, object]],
    *,
    generation_prompt: bool = True,
    continue_final: bool = False,
) -> str:
    """A ChatML-like template with the assistant turn opened; as vLLM's
    ``continue_final_message``, ``continue_final`` leaves the last message open (no end
    marker, no new turn) so generation continues its text."""
    if generation_prompt and continue_final:
        raise ValueError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    parts = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        head = f"<|im_start|>{msg.get('role', 'user')}\n{_content_text(msg)}"
        parts.append(head if continue_final and i == last else head + "<|im_end|>\n")
    if generation_prompt:
        parts.append(ASSISTANT_OPENER)
    return "".join(parts)


def _content_text(msg: dict[str, object]) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError("message content must be a string or a list of parts")
