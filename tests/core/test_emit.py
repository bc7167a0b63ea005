"""core/emit.py: the stop rules of a turn (EOS, stop strings, max_new_tokens) and the text they leave."""
from __future__ import annotations

from mindspore_eagle.config import GenerationConfig
from mindspore_eagle.core.emit import Emitter

EOS = 256


class ByteTok:
    """Byte-level tokenizer: token i < 256 is byte i; incomplete UTF-8 decodes as U+FFFD (as real BPE decoders do)."""

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def emit(text: str, **gen) -> Emitter:
    e = Emitter(ByteTok(), {EOS}, GenerationConfig(**gen))
    e.push_all(list(text.encode("utf-8")) + [EOS])
    return e


def test_length_cap_inside_a_multibyte_character_leaves_no_replacement_character():
    word = "שלום"                                   # 2 bytes a letter
    e = emit(word, max_new_tokens=5)               # 2 letters and half of the third
    assert e.reason == "length" and len(e.ids) == 5
    assert e.text() == "של"
    assert emit(word, max_new_tokens=8).text() == word                 # cut at a character boundary
    assert emit(word, max_new_tokens=32).text() == word and emit(word, max_new_tokens=32).reason == "eos"


def test_stop_strings_and_eos():
    e = emit("one, two. three", stop=["."], max_new_tokens=64)
    assert e.reason == "stop" and e.text() == "one, two"
    assert e.ids[-1] == ord(".")                   # the ids end where the stop string completed
    e = emit("hi", max_new_tokens=64)
    assert e.reason == "eos" and e.ids[-1] == EOS and e.text() == "hi"


def test_push_all_stops_at_the_end_of_the_turn_and_left_counts_down():
    e = Emitter(ByteTok(), {EOS}, GenerationConfig(max_new_tokens=4))
    assert e.left == 4
    assert e.push_all([65, 66]) == [65, 66] and e.left == 2 and not e.reason
    assert e.push_all([67, EOS, 68]) == [67, EOS] and e.reason == "eos"


def test_the_earliest_stop_match_wins_whatever_the_list_order():
    for stops in (["bc", "ab"], ["ab", "bc"]):
        e = emit("xabcd", stop=stops, max_new_tokens=64)
        assert e.reason == "stop" and e.text() == "x", stops


class CountingTok(ByteTok):
    def __init__(self):
        self.decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


def test_stop_check_decodes_a_bounded_tail_and_finds_what_a_full_decode_finds():
    """Each push decodes at most 4 * (longest stop) + 4 tokens, and the turn stops at the same token as a check
    of the whole text would: stop strings of multi-byte characters, split across tokens, found on completion."""
    import random

    rnd = random.Random(0)
    alphabet = ["a", "b", "é", "ש", "🙂", " "]
    for trial in range(300):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 40)))
        stops = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 3))) for _ in range(rnd.randint(1, 2))]
        tok = CountingTok()
        e = Emitter(tok, {EOS}, GenerationConfig(stop=stops, max_new_tokens=1000))
        e.push_all(list(text.encode("utf-8")))
        ids = list(text.encode("utf-8"))
        want = next((i + 1 for i in range(len(ids)) if any(s in ByteTok().decode(ids[: i + 1]) for s in stops)),
                    None)
        assert (e.reason == "stop") == (want is not None), (text, stops)
        if want is not None:
            assert len(e.ids) == want, (text, stops)
        assert tok.decoded <= len(e.ids) * (4 * max(len(s) for s in stops) + 4)
