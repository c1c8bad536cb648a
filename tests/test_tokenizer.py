"""The tokenizer and the prompt formats (mtp/tokenizer.py).

Our tiktoken-backed Tokenizer must encode exactly like Hugging Face's `tokenizers` library.

No downloads: the tests train tiny byte-level BPE tokenizers with the `tokenizers` library,
set up like Llama-3 (digits in runs of up to 3, specials after the vocab) and like Qwen2/3
(single digits, NFC normalisation; here the specials sit at the start of the vocab, as the
BPE trainer puts them), and compare encodings on text chosen to hit the corner cases.
"""
import base64
import json
import random
from pathlib import Path

import pytest
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from mtp.tokenizer import (DIGITS_THEN_GPT2_PATTERN, GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, Tokenizer,
                           bytes_to_piece, gpt2_byte_to_char, piece_to_bytes, prompt_tokens, response_tokens,
                           training_sequences)
from tasks.toy import TOY_PROMPT_WORDS, toy_tokenizer, toy_whole_tokens
from tasks.word_problems import word_problem_tokenizer

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we've got 12345 apples!",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 -42 1,234,567 and 2+2=4.",
    "Café, naïve, résumé, Zürich, São Paulo, Kraków. 東京 北京 こんにちは 世界 안녕하세요",
    "Emoji 😀🎉👍 and symbols → ≤ ≥ ∑ € £ ¥ © ®.\tTabs\tand\nnew\n\nlines   spaces.",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "I'm sure they'll say she'd DONE it; YOU'RE right, WE'VE seen it.",
] * 3
TEST_TEXT = [
    "", " ", "hello", " hello world", "Hello, World! How ARE you?",
    "The year 2024 had 366 days; 1234567890 is a long number, 007 too.",
    "3.14159 + 2.71828 = 5.85987", "a1b22c333d4444",
    "Café naïve résumé Ωμέγα Привет мир",
    "cafe\u0301 vs caf\u00e9 (NFD vs NFC)",
    "東京タワー と 北京 では 世界 が 見える。中文文本。",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧 flags 🇯🇵",
    "tabs\tand\ttabs\t\t", "lines\nand\n\n\nmore lines\r\nwindows\r\n",
    "many     spaces   between    words     ", "   leading and trailing   ",
    "nbsp\u00a0here and ideographic\u3000space",
    "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|>not special<|eot_id|>",
    "don't can't won't I'll we'd THEY'RE", "x" * 50 + " " + "9" * 20,
    "mixed: abc123def 12ab 1.2.3 v2.0-beta",
]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_hf(pattern, nfc, trainer_specials=(), added_specials=()):
    """A small byte-level BPE trained in-process, set up like the real Llama/Qwen files."""
    tok = HFTokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(trainer_specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.add_special_tokens(list(added_specials))
    return tok


def hf_ids(hf, text):
    """HF encoding of plain text: special-token text is NOT parsed (like our encode)."""
    hf.encode_special_tokens = True
    return hf.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = train_hf(LLAMA3_PATTERN, nfc=False, added_specials=LLAMA_SPECIALS)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}))
    eot = hf.token_to_id("<|eot_id|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot - 1, eot]}))
    return folder


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen")
    hf = train_hf(QWEN2_PATTERN, nfc=True, trainer_specials=QWEN_SPECIALS)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    return folder


def test_gpt2_byte_map_is_a_reversible_printable_alphabet():
    table = gpt2_byte_to_char()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("a")] == "a"
    assert piece_to_bytes(bytes_to_piece(bytes(range(256)))) == bytes(range(256))


@pytest.mark.parametrize("style", ["llama", "qwen"])
def test_encodings_match_hf_tokenizers(style, llama_dir, qwen_dir):
    folder = llama_dir if style == "llama" else qwen_dir
    ours, hf = Tokenizer.from_pretrained(folder), HFTokenizer.from_file(str(folder / "tokenizer.json"))
    assert ours.nfc == (style == "qwen")
    for text in TEST_TEXT:
        ids = ours.encode(text)
        assert ids == hf_ids(hf, text), text
        assert not set(ids) & set(ours.special_tokens.values())   # "<|im_start|>" stays text
        assert ours.decode(ids) == hf.decode(ids)
        if style == "llama":   # no normalisation: exact round trip
            assert ours.decode(ids) == text


def test_special_ids_and_roles(llama_dir, qwen_dir):
    llama, hf = Tokenizer.from_pretrained(llama_dir), HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    for text in LLAMA_SPECIALS:
        assert llama.token_id(text) == hf.token_to_id(text)
        assert llama.decode([llama.token_id(text)]) == text
    eot = llama.token_id("<|eot_id|>")
    assert (llama.bos_id, llama.eos_id, llama.pad_id) == (llama.token_id("<|begin_of_text|>"), eot, None)
    assert llama.stop_ids == [eot, eot - 1]
    assert llama.n_vocab == hf.get_vocab_size()

    qwen = Tokenizer.from_pretrained(qwen_dir)   # specials live at ids 0..2, inside the vocab
    assert [qwen.token_id(t) for t in QWEN_SPECIALS] == [0, 1, 2]
    assert qwen.bos_id is None   # tokenizer_config's null wins over config.json's bos_token_id
    assert (qwen.eos_id, qwen.pad_id, qwen.stop_ids) == (2, 0, [2, 0])
    assert qwen.decode([1] + qwen.encode("héllo") + [2]) == "<|im_start|>héllo<|im_end|>"


@pytest.mark.parametrize("style", ["llama", "qwen"])
def test_save_round_trip(style, llama_dir, qwen_dir, tmp_path):
    ours = Tokenizer.from_pretrained(llama_dir if style == "llama" else qwen_dir)
    ours.save_pretrained(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.mergeable_ranks == ours.mergeable_ranks
    assert again.special_tokens == ours.special_tokens
    assert (again.pattern, again.nfc) == (ours.pattern, ours.nfc)
    assert (again.bos_id, again.eos_id, again.pad_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    for text in TEST_TEXT:
        assert hf_ids(hf, text) == ours.encode(text) == again.encode(text), text
    for text, i in ours.special_tokens.items():
        assert hf.token_to_id(text) == i


def test_transformers_autotokenizer_loads_saved_files(llama_dir, tmp_path):
    from transformers import AutoTokenizer
    ours = Tokenizer.from_pretrained(llama_dir)
    ours.save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEST_TEXT[:12]:
        assert auto(text, add_special_tokens=True)["input_ids"] == ours.encode(text), text
    assert (auto.bos_token_id, auto.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_llama_original_tiktoken_model(llama_dir, tmp_path):
    """original/tokenizer.model holds only the ranks; the specials are computed."""
    from_json = Tokenizer.from_pretrained(llama_dir)
    (tmp_path / "original").mkdir()
    lines = [f"{base64.b64encode(token).decode()} {rank}"
             for token, rank in from_json.mergeable_ranks.items()]
    (tmp_path / "original" / "tokenizer.model").write_text("\n".join(lines) + "\n")
    tok = Tokenizer.from_pretrained(tmp_path)
    first = max(from_json.mergeable_ranks.values()) + 1
    assert tok.n_vocab == first + 256 and len(tok.special_tokens) == 256
    assert tok.bos_id == tok.token_id("<|begin_of_text|>") == first
    assert tok.eos_id == tok.token_id("<|end_of_text|>") == first + 1
    assert tok.token_id("<|eot_id|>") == first + 9
    assert tok.token_id("<|reserved_special_token_247|>") == first + 255
    for text in TEST_TEXT:
        assert tok.encode(text) == from_json.encode(text)


def test_toy_tokenizer_whole_tokens_and_round_trip(tmp_path):
    tok = toy_tokenizer()
    assert tok.n_vocab < 2500
    for word in toy_whole_tokens():
        assert len(tok.encode(word)) == 1, word
    text = "count from 7 by 3: 7 10 13 | repeat cat red pie then dog 999 times .\nstep 12\n"
    ids = tok.encode(text)
    assert len(ids) == 23 and tok.decode(ids) == text
    assert tok.encode(TOY_PROMPT_WORDS[0]) != tok.encode(" " + TOY_PROMPT_WORDS[0])
    assert tok.decode([tok.bos_id, tok.eos_id, tok.pad_id]) == "<|bos|><|eos|><|pad|>"
    assert tok.decode(tok.encode("any text: Ünïcode 😀")) == "any text: Ünïcode 😀"

    tok.save_pretrained(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size() == tok.n_vocab
    for t in [text] + toy_whole_tokens()[::7] + TEST_TEXT:
        assert hf_ids(hf, t) == tok.encode(t), t


def test_add_special_token_then_save(tmp_path):
    tok = toy_tokenizer()
    n = tok.n_vocab
    assert tok.mask_id is None
    assert tok.add_special_token("<mask>") == n == tok.mask_id and tok.n_vocab == n + 1
    assert tok.add_special_token("<mask>") == n   # adding twice is a no-op
    assert tok.decode([n]) == "<mask>" and tok.encode("<mask>") != [n]
    with pytest.raises(ValueError):
        tok.add_special_token("<clash>", token_id=5)   # 5 is the byte b"\x05"
    assert "<clash>" not in tok.special_tokens
    tok.save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    assert {"id": n, "content": "<mask>", "special": True}.items() <= \
        next(t for t in spec["added_tokens"] if t["content"] == "<mask>").items()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["mask_token"] == "<mask>"
    assert Tokenizer.from_pretrained(tmp_path).mask_id == n
    assert HFTokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("<mask>") == n


def test_gapped_special_ids_survive_save(tmp_path):
    """A special id away from the vocab's end forces HF to read its id from the vocab."""
    tok = toy_tokenizer()
    tok.add_special_token("<late>", token_id=tok.n_vocab + 10)
    tok.save_pretrained(tmp_path)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert all(hf.token_to_id(t) == i for t, i in tok.special_tokens.items())
    assert hf_ids(hf, "count 12 <late>") == tok.encode("count 12 <late>")


def test_missing_and_unsupported_tokenizers(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_pretrained(tmp_path)
    word_level = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="unsupported"):
        Tokenizer.from_pretrained(tmp_path)


# --- prompt formats ----------------------------------------------------------------------------

def test_plain_and_qwen_formats():
    """The plain format's tokens, and the qwen format's leading <|endoftext|>."""
    tok = word_problem_tokenizer()
    ids = prompt_tokens(tok, "plain", "Q?") + response_tokens(tok, "plain", "A")
    expected = [tok.bos_id] + tok.encode("Q?\n\n") + tok.encode("A") + [tok.eos_id]
    assert ids == expected
    seqs, _ = training_sequences([("Q?", "A")], tok, "plain", 12)
    assert seqs.shape == (1, 12)
    assert seqs[0, len(ids):].eq(tok.eos_id).all()
    tok.add_special_token("<|endoftext|>")
    assert prompt_tokens(tok, "qwen", "Q?")[0] == tok.token_id("<|endoftext|>")


# --- vocabularies that lack single bytes, split digits first (SmolLM2, StarCoder) ------------

def varied_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """TEST_TEXT plus random strings drawn from every kind of character a tokenizer meets."""
    rng = random.Random(seed)
    kinds = ["abc XYZ the of and", "0123456789", " ", "  ", "\t", "\n", "\r\n", ".,;:!?'\"()[]{}<>-_=+*/\\|#@$%^&~`",
             "éüßøñçÅÖ", "Ωμέγα Привет", "東京北京世界中文", "こんにちはカタカナ", "😀🎉👍🏽👨‍👩‍👧🇯🇵",
             "".join(map(chr, range(32))) + "\x7f", "\u00a0\u3000\u2003", "\U00010348\U00050000\U000f0000",
             "def f(x):\n    return x ** 2  # c\n", "'s 't 're 've 'm 'll 'd"]
    out = list(TEST_TEXT)
    for _ in range(n):
        parts = [rng.choice(kinds) for _ in range(rng.randint(1, 8))]
        text = "".join(p if rng.random() < 0.5 else "".join(rng.sample(p, min(len(p), rng.randint(1, 6))))
                       for p in parts)
        out.append(text)
    return out


def test_digits_first_vocab_with_missing_bytes_matches_hf(tmp_path):
    """Trained without the full byte alphabet, the vocab lacks most single bytes: `tokenizers`
    drops those bytes, and so must we; digits are split one by one before the GPT-2 split."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(vocab_size=500, special_tokens=QWEN_SPECIALS,
                                                           show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_pretrained(tmp_path)
    assert ours.pattern == DIGITS_THEN_GPT2_PATTERN and len(ours.missing_bytes) > 100
    for text in varied_corpus():
        assert ours.encode(text) == hf_ids(hf, text), repr(text)
    ours.add_special_token("<mask>")
    ours.save_pretrained(tmp_path / "saved")
    again = HFTokenizer.from_file(str(tmp_path / "saved" / "tokenizer.json"))
    assert again.token_to_id("<mask>") == ours.mask_id == ours.n_vocab - 1
    assert hf_ids(again, "digits 12345 and   777") == ours.encode("digits 12345 and   777")


def test_a_missing_byte_is_dropped_and_its_neighbours_merge():
    ranks = {bytes([b]): b for b in range(256) if b != 4}
    ranks[b"!?"] = 256
    tok = Tokenizer(ranks, {}, GPT2_PATTERN)
    assert tok.missing_bytes == b"\x04"
    assert tok.encode("!?") == tok.encode("!\x04?") == [256]      # one piece "!\x04?" -> "!?"
    assert tok.encode("\x04") == [] and tok.encode("x \x04") == [ord("x"), ord(" ")]


SMOLLM2 = Path(__file__).resolve().parent.parent / "models" / "smollm2"
needs_smollm2 = pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(),
                                   reason="no converted SmolLM2 (python scripts/get_smollm2.py models/smollm2)")


@needs_smollm2
def test_smollm2_tokenizer_matches_hf():
    ours, hf = Tokenizer.from_pretrained(SMOLLM2), HFTokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    assert len(ours.missing_bytes) == 21 and ours.n_vocab == 49152
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    for text in varied_corpus(2000, seed=1):
        ids = ours.encode(text)
        assert ids == hf_ids(hf, text), repr(text)
        assert ours.decode(ids) == hf.decode(ids)
