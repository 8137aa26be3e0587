"""stop-strings-bytes: ``stop_strings`` that are not ASCII stop generation on byte-level tokenizers.

Two tokenizers are built here by hand (no hub): a GPT-2 style ``ByteLevel`` BPE (256 byte tokens
and a few merges: "你", "好", "世界", "stop", " stop") and a Llama-2 style BPE with ``<0xNN>``
byte-fallback tokens, whole-character pieces and "▁" for spaces. Each stop string is spelled
several ways: as the tokenizer encodes it, as single byte tokens, half and half, with text
before and after, and cut short (which must not stop).

The control is a criterion written here that needs no vocabulary tables: it joins the bytes of a
row's tokens and stops when a stop string's bytes end inside the newest token (what
``StopStringCriteria`` promises). On 5.12.0+ stock must agree with it everywhere (the upstream
fix, which then vouches for the control); on 4.55.0 - 5.11.x stock raises the ``ValueError``
(no token holds the whole last character: "🙂", "é") or misses spellings with byte tokens
("你好", "界"), and the overlay agrees with the control everywhere: in the criterion's answers
and in the ids of ``generate(stop_strings=..., tokenizer=...)`` with a tiny random Llama forced to
emit chosen tokens. ASCII stop strings ("stop") are left to the release's own code.
"""

from __future__ import annotations

import inspect

import pytest

import overlay
from overlay.testing.harness import PatchUnderTest

PATCH = PatchUnderTest("stop_strings_bytes")
PATCH.skip_module_unless_covered()
NOT_FOUND_ERROR = PATCH.error("unable to identify tokens")

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZERS = ("byte-level", "byte-fallback")
#: "🙂" and "é": no token holds the whole character (stock raises); "你好", "界": merged tokens
#: hold them, byte tokens do not (stock misses those); "stop": ASCII (stock right, untouched).
STOP_STRINGS = ("🙂", "é", "你好", "界", "你好!", "好 stop", "stop")
NON_ASCII = tuple(s for s in STOP_STRINGS if not s.isascii())
PROMPT_TEXT = "ab cd"
MAX_NEW_TOKENS = 16


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the vocabulary's own spelling)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


ALPHABET = _byte_alphabet()


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ALPHABET[b]: 3 + b for b in range(256)})
    merges = []
    for word in ("你", "好", "世界", "stop", " stop"):
        spelled = [ALPHABET[b] for b in word.encode()]
        merged = spelled[0]
        for piece in spelled[1:]:
            if (merged, piece) not in merges:
                merges.append((merged, piece))
            merged += piece
            vocab.setdefault(merged, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _byte_fallback_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in "▁abcdefghijklmnopqrstuvwxyz!你好世界":
        vocab.setdefault(char, len(vocab))
    merges = [("s", "t"), ("o", "p"), ("st", "op"), ("▁", "stop"), ("你", "好"), ("世", "界")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tokenizers():
    return {"byte-level": _byte_level_tokenizer(), "byte-fallback": _byte_fallback_tokenizer()}


def _token_bytes(kind: str, tokenizer) -> dict[int, bytes]:
    """Every id -> the bytes it spells, read off how the vocabularies above were written."""
    spelled = {}
    for token, index in tokenizer.get_vocab().items():
        if kind == "byte-level":
            byte_of = {char: b for b, char in ALPHABET.items()}
            spelled[index] = bytes(byte_of[c] for c in token)
        elif token.startswith("<0x"):
            spelled[index] = bytes((int(token[3:5], 16),))
        else:
            spelled[index] = token.replace("▁", " ").encode()
    return spelled


def _byte_ids(kind: str, tokenizer, data: bytes) -> list[int]:
    names = [ALPHABET[b] if kind == "byte-level" else f"<0x{b:02X}>" for b in data]
    return tokenizer.convert_tokens_to_ids(names)


def _encoded(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _continuation(kind: str, tokenizer, text: str) -> list[int]:
    """``text`` as the tokenizer encodes it in the middle of a text: without the "▁" the
    byte-fallback tokenizer puts before a text's start (encoded after an "a", which is dropped)."""
    spelled = _token_bytes(kind, tokenizer)
    ids = _encoded(tokenizer, "a" + text)
    lead = b" a" if kind == "byte-fallback" else b"a"
    for cut in range(len(ids) + 1):
        if b"".join(spelled[i] for i in ids[:cut]) == lead:
            return ids[cut:]
    raise AssertionError(f"{text!r} does not follow 'a' cleanly: {ids}")


def _spellings(kind: str, tokenizer, stop: str) -> dict[str, list[int]]:
    """Token sequences whose text ends with ``stop``, then two that do not end the newest token
    with it ("cut short": all but its last byte; "another token after it")."""
    data = stop.encode()
    first = stop[0].encode()
    rest = _continuation(kind, tokenizer, stop[1:]) if len(stop) > 1 else []
    return {
        "encoded": _encoded(tokenizer, "ab" + stop),
        "bytes": _encoded(tokenizer, "ab") + _byte_ids(kind, tokenizer, data),
        "first char encoded, rest bytes": _encoded(tokenizer, "ab" + stop[0])
        + _byte_ids(kind, tokenizer, data[len(first) :]),
        "first char in bytes, rest encoded": _byte_ids(kind, tokenizer, first) + rest,
        "cut short": _encoded(tokenizer, "ab") + _byte_ids(kind, tokenizer, data[:-1]),
        "another token after it": _encoded(tokenizer, "ab" + stop) + _encoded(tokenizer, "x")[-1:],
    }


NEGATIVE_SPELLINGS = ("cut short", "another token after it")


def _reference_fires(spelled: dict[int, bytes], stops: tuple[str, ...], row: list[int]) -> bool:
    """Does a stop string's last byte lie inside the row's newest token?"""
    text = b"".join(spelled[i] for i in row)
    newest = len(spelled[row[-1]])
    return any(s.encode() in text[max(0, len(text) - newest - len(s.encode()) + 1) :] for s in stops)


def _criterion_answers(tokenizer, stops, rows):
    """``StopStringCriteria(tokenizer, stops)`` on each row: ``[bool, ...]``, or the error text."""
    import torch
    from transformers.generation.stopping_criteria import StopStringCriteria

    try:
        criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=list(stops))
    except ValueError as exc:
        return str(exc)
    return [bool(criterion(torch.tensor([row]), None)[0]) for row in rows]


@pytest.fixture(scope="module")
def criterion_runs(tokenizers):
    """``{(tokenizer, stop): {"rows", "reference", "stock", "patched"}}``."""
    import transformers.generation.stopping_criteria  # noqa: F401  (the patch's module, judged by the engine)

    results = {}
    for kind, tokenizer in tokenizers.items():
        spelled = _token_bytes(kind, tokenizer)
        for stop in STOP_STRINGS:
            rows = _spellings(kind, tokenizer, stop)
            record = results[kind, stop] = {"rows": rows}
            record["reference"] = [_reference_fires(spelled, (stop,), row) for row in rows.values()]
            with overlay.reverted():
                record["stock"] = _criterion_answers(tokenizer, (stop,), rows.values())
            with PATCH.applied():
                record["patched"] = _criterion_answers(tokenizer, (stop,), rows.values())
    return results


CRITERION_CASES = pytest.mark.parametrize("kind,stop", [(k, s) for k in TOKENIZERS for s in STOP_STRINGS])


def test_replacement_keeps_name_docstring_and_signature():
    (target, stock), = PATCH.present_targets()
    variant = target.variant_of(stock)
    if PATCH.affected:
        assert variant is not None
    replacement = target.replace(stock, variant)
    assert replacement.__wrapped__ is stock
    assert (replacement.__name__, replacement.__doc__) == (stock.__name__, stock.__doc__)
    assert inspect.signature(replacement) == inspect.signature(stock)


def test_the_control_stops_only_where_the_stop_string_ends(criterion_runs):
    """The control itself: it stops on every spelling but the two that do not end with the stop string."""
    for record in criterion_runs.values():
        assert record["reference"] == [name not in NEGATIVE_SPELLINGS for name in record["rows"]], record


@CRITERION_CASES
def test_stock(criterion_runs, kind, stop):
    """Affected releases: a stop string that is not ASCII raises, or some spelling is missed; an
    ASCII one is matched right. Fixed releases: stock is the control everywhere."""
    record = criterion_runs[kind, stop]
    if not PATCH.affected or stop.isascii():
        assert record["stock"] == record["reference"], record
    elif stop in ("🙂", "é"):
        assert record["stock"] == NOT_FOUND_ERROR
    else:
        assert record["stock"] != record["reference"], "the bug: a byte-token spelling never stops"
        missed = [name for name, s, r in zip(record["rows"], record["stock"], record["reference"]) if s != r]
        assert "bytes" in missed and all(r for name, r in zip(record["rows"], record["reference"]) if name in missed)


@CRITERION_CASES
def test_overlay_matches_the_control(criterion_runs, kind, stop):
    record = criterion_runs[kind, stop]
    assert record["patched"] == record["reference"], record


def test_several_stop_strings_at_once(tokenizers):
    """One criterion for ASCII and non-ASCII stop strings together: each stops where the control does."""
    kind = "byte-level"
    tokenizer = tokenizers[kind]
    spelled = _token_bytes(kind, tokenizer)
    stops = ("stop", "你好", "🙂")
    rows = [row for stop in stops for row in _spellings(kind, tokenizer, stop).values()]
    reference = [_reference_fires(spelled, stops, row) for row in rows]
    with PATCH.applied():
        assert _criterion_answers(tokenizer, stops, rows) == reference


def test_ascii_stop_strings_keep_the_release_tables(tokenizers):
    """ASCII stop strings: the release's own code, same tables, nothing recorded."""
    from overlay import report
    from transformers.generation.stopping_criteria import StopStringCriteria

    for tokenizer in tokenizers.values():
        with overlay.reverted():
            stock = StopStringCriteria(tokenizer, ["stop", " a"])
        report.reset()
        with PATCH.applied():
            patched = StopStringCriteria(tokenizer, ["stop", " a"])
        assert report.fired().get(PATCH.id, 0) == 0
        assert patched.stop_strings == stock.stop_strings == ("stop", " a")
        assert patched.embedding_vec.equal(stock.embedding_vec)
        assert (patched.maximum_token_len, patched.target_lens.tolist()) == (
            stock.maximum_token_len,
            stock.target_lens.tolist(),
        )


def test_patched_criterion_keeps_the_strings_and_counts_bytes(tokenizers):
    from overlay import report
    from transformers.generation.stopping_criteria import StopStringCriteria

    report.reset()
    with PATCH.applied():
        criterion = StopStringCriteria(tokenizers["byte-level"], "你好")
    assert criterion.stop_strings == ("你好",)
    assert "clean_tokenizer_vocab" not in vars(criterion)
    # Six bytes, the lengths a byte-by-byte spelling needs (5.12.0 counts the same).
    assert (criterion.maximum_token_len, criterion.target_lens.tolist()) == (6, [6])
    assert report.fired().get(PATCH.id, 0) == (1 if PATCH.affected else 0)


# -- generate() -------------------------------------------------------------------------------


class _Forced:
    """A logits processor that makes row ``r`` emit ``plans[r][step]`` (then a filler token)."""

    def __init__(self, prompt_len: int, plans: list[list[int]], filler: int):
        self.prompt_len, self.plans, self.filler = prompt_len, plans, filler

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        forced = scores.new_full(scores.shape, float("-inf"))
        for row, plan in enumerate(self.plans):
            forced[row, plan[step] if step < len(plan) else self.filler] = 0.0
        return forced


def _generate(model, vocabulary, plans, prompt, /, **kwargs):
    """Forced greedy generate() of ``plans`` after ``prompt``: ids, or the ValueError's text."""
    import torch
    from transformers import LogitsProcessorList

    from overlay.testing.models import greedy_ids

    batch = {"input_ids": torch.tensor([prompt] * len(plans))}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    forced = LogitsProcessorList([_Forced(len(prompt), plans, filler=vocabulary.convert_tokens_to_ids("x"))])
    try:
        return greedy_ids(model, batch, MAX_NEW_TOKENS, logits_processor=forced, **kwargs)
    except ValueError as exc:
        return str(exc)


class _ControlCriterion:
    """The control as a stopping criterion (a ``StoppingCriteria`` built on first use)."""

    def __new__(cls, spelled, stops):
        import torch
        from transformers import StoppingCriteria

        class Control(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                rows = input_ids.tolist()
                return torch.tensor([_reference_fires(spelled, stops, row) for row in rows], device=input_ids.device)

        return Control()


GENERATE_STOPS = ("🙂", "你好", "界", "stop")


@pytest.fixture(scope="module")
def generate_runs(tokenizers):
    """``{(tokenizer, stop): {"reference", "stock", "patched"}}``: a two-row batch where row 0
    spells the stop string in byte tokens after three tokens, row 1 as the tokenizer encodes it
    after five."""
    from transformers import StoppingCriteriaList

    from overlay.testing.models import tiny_model

    results = {}
    for kind, tokenizer in tokenizers.items():
        model = tiny_model("llama", vocab_size=len(tokenizer))
        spelled = _token_bytes(kind, tokenizer)
        prompt = _encoded(tokenizer, PROMPT_TEXT)
        for stop in GENERATE_STOPS:
            lead = [tokenizer.convert_tokens_to_ids("x")]
            plans = [
                lead * 3 + _byte_ids(kind, tokenizer, stop.encode()),
                lead * 5 + _encoded(tokenizer, stop),
            ]
            record = results[kind, stop] = {}
            with overlay.reverted():
                control = StoppingCriteriaList([_ControlCriterion(spelled, (stop,))])
                record["reference"] = _generate(model, tokenizer, plans, prompt, stopping_criteria=control)
                record["stock"] = _generate(model, tokenizer, plans, prompt, stop_strings=[stop], tokenizer=tokenizer)
            with PATCH.applied():
                record["patched"] = _generate(model, tokenizer, plans, prompt, stop_strings=[stop], tokenizer=tokenizer)
    return results


GENERATE_CASES = pytest.mark.parametrize("kind,stop", [(k, s) for k in TOKENIZERS for s in GENERATE_STOPS])


@GENERATE_CASES
def test_generate_control_stops_each_row_after_its_stop_string(generate_runs, tokenizers, kind, stop):
    from overlay.testing.models import PAD_TOKEN_ID

    tokenizer = tokenizers[kind]
    reference = generate_runs[kind, stop]["reference"]
    prompt_len = len(_encoded(tokenizer, PROMPT_TEXT))
    assert isinstance(reference, list)
    spelled = _token_bytes(kind, tokenizer)
    for row in reference:
        new = [i for i in row[prompt_len:] if i != PAD_TOKEN_ID]
        assert b"".join(spelled[i] for i in new).endswith(stop.encode()), (row, stop)
    assert len(reference[0]) < prompt_len + MAX_NEW_TOKENS


@GENERATE_CASES
def test_generate_stock(generate_runs, kind, stop):
    record = generate_runs[kind, stop]
    if not PATCH.affected or stop.isascii():
        assert record["stock"] == record["reference"]
    elif stop == "🙂":
        assert record["stock"] == NOT_FOUND_ERROR
    else:
        # The byte-token row runs on to max_new_tokens (the batch with it).
        assert isinstance(record["stock"], list) and record["stock"] != record["reference"]
        assert len(record["stock"][0]) > len(record["reference"][0])


@GENERATE_CASES
def test_generate_overlay_gives_the_control_ids(generate_runs, kind, stop):
    record = generate_runs[kind, stop]
    assert record["patched"] == record["reference"]


#: What this patch changes (its declaration's ``changes``), the test here that shows it, and how
#: (tests/patches/test_patch_declarations.py holds the three together).
CHANGES_EVIDENCE = ('both', 'test_generate_stock',
                    'stock raises ValueError building the criterion, or completes past the stop string')
