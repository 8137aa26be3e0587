"""``stop_strings`` with CJK text or emoji stop generation on byte-level tokenizers, as upstream now.

What breaks: ``model.generate(..., stop_strings=[...], tokenizer=tok)`` with a stop string that is
not plain ASCII (Chinese, Japanese, Korean, emoji, accented letters) and a byte-level tokenizer
(GPT-2 style ``ByteLevel`` BPE: Qwen, Llama 3, GPT-2...; or ``<0xNN>`` byte-fallback tokens:
Llama 2, Mistral, Gemma...). Either building the criterion fails with ``ValueError: Stop string
preprocessing was unable to identify tokens matching one or more of the supplied stop string(s).
This is most often caused by the stop strings containing unusual characters that are not in the
tokenizer vocabulary.`` (no token holds the whole last character, e.g. an emoji), or, with no
error, generation runs past the stop string to ``max_new_tokens`` whenever the model spells a
character of it with byte tokens (upstream issue #46519).

Cause: ``StopStringCriteria`` matches in characters and learns what each vocabulary entry spells
by decoding it alone. A token that holds only some of a character's UTF-8 bytes decodes to
U+FFFD, so it matches no stop string, and a stop string whose characters arrive as such tokens
is never seen.

Upstream (5.12.0): for tokenizers whose decoder is ``ByteLevel`` or uses ``ByteFallback``, stop
strings and tokens are compared as UTF-8 bytes (each byte-level token mapped to its bytes).

What the replacement does: it wraps ``StopStringCriteria.__init__``. When every stop string is
ASCII, or the tokenizer is neither kind, it calls the original unchanged (the cost: one
``isascii()`` per stop string, once per generate() call). Otherwise it detects the decoder kind
as 5.12.0 does and calls the original with the stop strings as UTF-8 bytes, while the instance's
``clean_tokenizer_vocab`` returns each token's bytes: the release's own decoded strings, encoded,
with the byte tokens (every character in the byte-level alphabet, or ``<0xNN>``) replaced by
their exact bytes. The release's own table building, cache and ``__call__`` (unchanged: plain
tensor code) then run in bytes, so ``maximum_token_len`` and the target lengths are byte counts as
upstream's. ``stop_strings`` keeps the strings given. The byte tables are cached under the bytes
stop strings, apart from the stock entries.

Limits: slow (Python) tokenizers without ``backend_tokenizer`` keep the stock behaviour, as in
5.12.0. For ASCII stop strings nothing changes (byte and character matching agree there).

Tested (``tests/patches/stop_strings_bytes/``): hand-built byte-level and byte-fallback
tokenizers, the criterion called on fixed ids and a tiny random Llama forced to spell the stop
string with merged and with byte tokens; stock raises or never fires, the overlay stops where a
byte-exact reference criterion (and 5.12.x itself) stops, with the same ids. See
``docs/patches/stop-strings-bytes.md``.
"""

from __future__ import annotations

from overlay import report
from overlay.patch import Target, wraps
from overlay.releases import patch_with_release_facts

PATCH_ID = "stop-strings-bytes"
MODULE = "transformers.generation.stopping_criteria"

BYTE_LEVEL = "byte_level"
BYTE_FALLBACK = "byte_fallback"
_HEX = frozenset("0123456789abcdefABCDEF")
_byte_level_alphabet: dict[str, int] | None = None


def _decoder_kind(tokenizer) -> str | None:
    """``BYTE_LEVEL``, ``BYTE_FALLBACK`` or None, decided from the fast tokenizer's decoder in the
    same order as 5.12.0 (a ``ByteLevel`` decoder object first, then the serialized decoder's
    types, where ``ByteFallback`` wins over ``ByteLevel``): the same tokenizers match in bytes."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    if type(decoder).__name__ == "ByteLevel":
        return BYTE_LEVEL
    import json

    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    kinds: set = set()
    pending = [state]
    while pending:  # every "type" anywhere in the tree (a Sequence nests its decoders)
        node = pending.pop()
        if isinstance(node, dict):
            kinds.add(node.get("type"))
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    if "ByteFallback" in kinds:
        return BYTE_FALLBACK
    if "ByteLevel" in kinds:
        return BYTE_LEVEL
    return None


def _alphabet() -> dict[str, int]:
    """The byte-level alphabet, character -> byte (the release's own table, inverted once)."""
    global _byte_level_alphabet
    if _byte_level_alphabet is None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        _byte_level_alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
    return _byte_level_alphabet


def _token_bytes(token: str, decoded: str, kind: str) -> bytes:
    """What ``token`` spells, in bytes; ``decoded`` is the release's own string for it."""
    if kind == BYTE_LEVEL:
        alphabet = _alphabet()
        if all(char in alphabet for char in token):
            return bytes(alphabet[char] for char in token)
    elif len(token) == 6 and token.startswith("<0x") and token.endswith(">") and set(token[3:5]) <= _HEX:
        return bytes((int(token[3:5], 16),))
    # Added and special tokens outside the alphabet, and byte-fallback's ordinary pieces: their
    # decoded text is whole characters, so its UTF-8 encoding is exact.
    return decoded.encode("utf-8")


def _vocab_in_bytes(clean_tokenizer_vocab, kind: str):
    """``clean_tokenizer_vocab`` for one criterion: the release's own, then each entry in bytes."""

    def clean_tokenizer_vocab_in_bytes(tokenizer, static_prefix="abcdef"):
        strings, indices = clean_tokenizer_vocab(tokenizer, static_prefix)
        # Paired by id, not by position: a fast tokenizer's get_vocab() order is not promised.
        token_of = {index: token for token, index in tokenizer.get_vocab().items()}
        return tuple(_token_bytes(token_of[i], s, kind) for s, i in zip(strings, indices, strict=True)), indices

    return clean_tokenizer_vocab_in_bytes


def _replace_init(original, variant):
    @wraps(original)
    def __init__(self, tokenizer, stop_strings):
        strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
        if not any(isinstance(s, str) and not s.isascii() for s in strings):
            return original(self, tokenizer, stop_strings)
        kind = _decoder_kind(tokenizer)
        if kind is None or not all(isinstance(s, str) for s in strings):
            return original(self, tokenizer, stop_strings)
        # An instance attribute shadows the static method for this criterion only: other
        # criteria, other threads and the release's cache entries for str keys are untouched.
        self.clean_tokenizer_vocab = _vocab_in_bytes(self.clean_tokenizer_vocab, kind)
        try:
            original(self, tokenizer, [s.encode("utf-8") for s in strings])
        finally:
            del self.clean_tokenizer_vocab
        self.stop_strings = strings
        report.record(PATCH_ID, f"matched stop strings in bytes ({kind})")

    return __init__


PATCH = patch_with_release_facts(
    id=PATCH_ID,
    changes="both",
    title="stop_strings with CJK text or emoji stop generation on byte-level tokenizers",
    errors=(
        "ValueError: Stop string preprocessing was unable to identify tokens matching one or more of the "
        "supplied stop string(s). This is most often caused by the stop strings containing unusual "
        "characters that are not in the tokenizer vocabulary.",
        "(no error) generate(stop_strings=[...]) never stops at a CJK or emoji stop string the model "
        "spells with byte tokens",
    ),
    why=(
        "StopStringCriteria matches characters and decodes each token alone, so tokens holding part of a "
        "character's UTF-8 bytes match nothing."
    ),
    upstream="huggingface/transformers#46522 (issue #46519; matches in bytes for byte-level tokenizers), in {fixed_in}",
    targets=(
        Target(
            module=MODULE,
            qualname="StopStringCriteria.__init__",
            replace=_replace_init,
        ),
    ),
)
