"""Data for multi-token prediction: tokenizers, toy tasks, the packed MTP layout, prompt formats,
word problems.

Five sections, each one part of the lesson:

  Tokenizers           byte-level BPE over tiktoken, read from (and written back to) a Hugging
                       Face tokenizer.json or a Llama tokenizer.model, plus the toy vocabulary.
  Toy tasks            counting and repetition (one right answer) and two tasks with a branch
                       point (several valid answers, each fixing what follows), with checkers
                       for accuracy, coherence and degeneration, and held-out prompts.
  MTP training layout  one ground-truth sequence -> one packed sequence holding many MTP
                       problems: mask slots, re-placed copies, positions, the block-causal
                       attention mask and the prediction targets.
  Prompt formats       how finetune_hf.py turns (prompt, response) pairs into token ids
                       (Llama-3 chat, Qwen, plain).
  Word problems        synthetic grade-school arithmetic in MetaMathQA and GSM8K formats, for
                       the miniature reproduction in finetune_hf.py.
"""
import base64
import json
import random
import unicodedata
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import regex  # tiktoken's dependency: the same regular expressions as its splitter
import tiktoken
import torch

# =============================================================================================
# Tokenizers
# =============================================================================================
#
# Byte-level BPE in four facts.
#  1. Text is UTF-8 bytes, so 256 single-byte tokens can spell ANY text: nothing is "unknown".
#  2. A regex first cuts the text into pieces (words with their leading space, digit runs,
#     punctuation runs, whitespace runs). Tokens never cross piece boundaries.
#  3. Every multi-byte token has a RANK, and in tiktoken the rank is also the token id. Inside
#     a piece, start from single bytes and repeatedly merge the adjacent pair whose
#     concatenation is the lowest-ranked token; stop when no adjacent pair is a token. (A
#     piece that is itself a token is looked up directly.)
#  4. Hugging Face's tokenizer.json stores the same thing differently: `model.vocab` maps
#     token STRINGS to ids plus an explicit `merges` list. JSON wants printable strings, so
#     GPT-2 introduced a reversible byte -> character map: printable bytes stand for
#     themselves, the 68 others (control bytes, space, ...) are shifted to chr(256 + i); the
#     space byte becomes "Ġ". Inverting that map turns each vocab string back into raw bytes.
#
# We run tiktoken (fast, in Rust) and only translate formats here. `added_tokens` (and
# Llama's <|begin_of_text|> etc.) become tiktoken "special tokens": matched by exact id, never
# produced by encode(), so a user typing "<|im_start|>" gets ordinary text tokens.

# Split patterns. Llama-3 groups digits in runs of up to three; Qwen2/3 splits every digit.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# GPT-2's simpler pattern: a leading space attaches to a run of letters or of digits.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 (and StarCoder) first cut every digit out as its own piece, then split the rest with
# GPT-2's pattern. As ONE pattern: a digit alone; no " 123" piece; and a whitespace run may end
# where a digit starts, as it would at the end of a piece.
DIGITS_THEN_GPT2_PATTERN = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"""
                            r"""|\s+(?![^\s\p{N}])|\s+""")


@lru_cache(maxsize=1)
def gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's map from each byte value to a printable character (see fact 4 above)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    shifted = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


@lru_cache(maxsize=1)
def gpt2_char_to_byte() -> dict[str, int]:
    return {c: b for b, c in gpt2_byte_to_char().items()}


def bytes_to_piece(token: bytes) -> str:
    return "".join(gpt2_byte_to_char()[b] for b in token)


def piece_to_bytes(piece: str) -> bytes:
    return bytes(gpt2_char_to_byte()[c] for c in piece)   # KeyError: not a byte-level string


def llama3_special_tokens(first_id: int, count: int = 256) -> dict[str, int]:
    """Llama 3.1's 256 special tokens: a few named ones, the rest <|reserved_special_token_i|>."""
    named = {0: "begin_of_text", 1: "end_of_text", 4: "finetune_right_pad_id",
             6: "start_header_id", 7: "end_header_id", 8: "eom_id", 9: "eot_id", 10: "python_tag"}
    specials, n_reserved = {}, 0
    for offset in range(count):
        name = named.get(offset)
        if name is None:
            name, n_reserved = f"reserved_special_token_{n_reserved}", n_reserved + 1
        specials[f"<|{name}|>"] = first_id + offset
    return specials


def bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merge loop on `token`'s bytes, allowed to use only ranks below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pair_ranks = [ranks.get(a + b, max_rank) for a, b in zip(parts, parts[1:])]
        best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)   # leftmost on ties
        if pair_ranks[best] >= max_rank:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


class Tokenizer:
    """Byte-level BPE backed by tiktoken; reads and writes Hugging Face tokenizer files."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int],
                 pattern: str, nfc: bool = False, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None):
        self.mergeable_ranks = dict(mergeable_ranks)
        self.special_tokens = dict(special_tokens)
        self.pattern, self.nfc = pattern, nfc
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        # Real vocabularies may lack single bytes (SmolLM2 lacks 21, e.g. 0x04 and 0xFF). With no
        # unknown token, `tokenizers` drops such bytes from each piece before merging; see encode().
        self.missing_bytes = bytes(b for b in range(256) if bytes([b]) not in self.mergeable_ranks)
        self._enc = self._build(self.special_tokens)
        self.stop_ids = [self.eos_id] if eos_token else []   # ids that end generation
        self.hf_spec, self.chat_template = None, None          # set when read from Hugging Face files

    def _build(self, specials: dict[str, int]) -> tiktoken.Encoding:
        """Check what tiktoken would not (it panics or silently misbehaves), then build it."""
        ranks = self.mergeable_ranks
        ids = [*ranks.values(), *specials.values()]
        if len(set(ids)) != len(ids):
            raise ValueError("two tokens share an id (ordinary and special ids must not overlap)")
        for role in (self.bos_token, self.eos_token, self.pad_token):
            if role is not None and role not in specials:
                raise ValueError(f"{role!r} is not a special token")
        return tiktoken.Encoding("bpe", pat_str=self.pattern, mergeable_ranks=ranks,
                                 special_tokens=specials)

    # --- ids and text -----------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self._enc.n_vocab   # max id + 1 (ids may have gaps)

    def token_id(self, text: str) -> int:
        if text not in self.special_tokens:
            raise KeyError(f"{text!r} is not a special token of this tokenizer")
        return self.special_tokens[text]

    def _role_id(self, text: str | None) -> int | None:
        return None if text is None else self.token_id(text)

    bos_id = property(lambda self: self._role_id(self.bos_token))
    eos_id = property(lambda self: self._role_id(self.eos_token))
    pad_id = property(lambda self: self._role_id(self.pad_token))
    mask_id = property(lambda self: self.special_tokens.get("<mask>"))

    def encode(self, text: str) -> list[int]:
        """Ordinary text -> ids: no BOS added, special-token text is NOT parsed."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        if not self.missing_bytes or len(text.encode().translate(None, self.missing_bytes)) == len(text.encode()):
            return self._enc.encode_ordinary(text)
        ids = []   # rare: split, drop the bytes the vocab lacks from each piece, then merge what is left
        for piece in regex.findall(self.pattern, text):
            kept = piece.encode().translate(None, self.missing_bytes)
            ids += self._enc._encode_single_piece(kept) if kept else []
        return ids

    def decode_bytes(self, ids) -> bytes:
        return self._enc.decode_bytes([int(i) for i in ids])

    def decode(self, ids) -> str:
        """Special ids decode to their text; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def add_special_token(self, text: str, token_id: int | None = None) -> int:
        """Add a special token (default id: n_vocab) and rebuild the encoder; returns its id."""
        if text in self.special_tokens and token_id in (None, self.special_tokens[text]):
            return self.special_tokens[text]
        specials = {**self.special_tokens, text: self.n_vocab if token_id is None else int(token_id)}
        self._enc = self._build(specials)   # raises (and changes nothing) on an id clash
        self.special_tokens = specials
        return specials[text]

    # --- Hugging Face files ---------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """Load from a folder holding tokenizer.json or (Llama) original/tokenizer.model."""
        folder = Path(path)
        llama_model = folder / "original" / "tokenizer.model"
        if (folder / "tokenizer.json").is_file():
            ranks, specials, pattern, nfc = read_hf_tokenizer_json(folder / "tokenizer.json")
            roles, stop_ids = read_token_roles(folder, specials)
        elif llama_model.is_file():
            ranks = read_tiktoken_ranks(llama_model)
            specials = llama3_special_tokens(max(ranks.values()) + 1)
            pattern, nfc = LLAMA3_PATTERN, False
            roles, stop_ids = read_token_roles(folder, specials)
            roles["bos_token"] = roles["bos_token"] or "<|begin_of_text|>"
            roles["eos_token"] = roles["eos_token"] or "<|end_of_text|>"
        else:
            raise FileNotFoundError(f"no tokenizer.json or original/tokenizer.model in {folder}")
        tokenizer = cls(ranks, specials, pattern, nfc, **roles)
        tokenizer.stop_ids = list(dict.fromkeys(tokenizer.stop_ids + stop_ids))
        if (folder / "tokenizer.json").is_file():
            tokenizer.hf_spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        config = folder / "tokenizer_config.json"
        if config.is_file():
            tokenizer.chat_template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        return tokenizer

    def hf_tokenizer_json(self) -> dict:
        """The tokenizer.json dict: the file we were read from with our added special tokens, or
        (for tokenizers built in code) vocab + merges that make HF's BPE act exactly as ours."""
        if self.hf_spec is not None:
            known = {t["content"] for t in self.hf_spec["added_tokens"]}
            added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True}
                     for text, i in self.special_tokens.items() if text not in known]
            return {**self.hf_spec, "added_tokens": self.hf_spec["added_tokens"] + added}
        vocab = {bytes_to_piece(b): r for b, r in self.mergeable_ranks.items()}
        merges = []
        for token, rank in sorted(self.mergeable_ranks.items(), key=lambda item: item[1]):
            parts = bpe_parts(self.mergeable_ranks, token, rank) if len(token) > 1 else []
            if len(parts) == 2:   # the last merge tiktoken would make to build this token
                merges.append([bytes_to_piece(parts[0]), bytes_to_piece(parts[1])])
        # HF numbers added tokens it does not find in the vocab len(vocab), len(vocab)+1, ...
        # If ours are not exactly those ids, put them in the vocab too so their ids are kept.
        specials = sorted(self.special_tokens.items(), key=lambda item: item[1])
        if [i for _, i in specials] != list(range(len(vocab), len(vocab) + len(specials))):
            vocab.update(specials)
        split = {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated",
                 "invert": False}
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": False}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}
                             for text, i in specials],
            "normalizer": {"type": "NFC"} if self.nfc else None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
            "post_processor": None,
            "decoder": {**byte_level, "add_prefix_space": True, "use_regex": True},
            # ignore_merges: a piece that is itself a token is looked up whole, as tiktoken does
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                      "vocab": vocab, "merges": merges},
        }

    def save_pretrained(self, path):
        """Write tokenizer.json + tokenizer_config.json (loadable by `tokenizers`/AutoTokenizer)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "tokenizer.json", "w", encoding="utf-8") as f:
            json.dump(self.hf_tokenizer_json(), f, ensure_ascii=False)
        roles = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "pad_token": self.pad_token, "mask_token": "<mask>" if self.mask_id is not None else None}
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False,
                  **{key: text for key, text in roles.items() if text is not None}}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(folder / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)


def read_hf_tokenizer_json(file: Path) -> tuple[dict[bytes, int], dict[str, int], str, bool]:
    """tokenizer.json -> (mergeable_ranks, special_tokens, split pattern, nfc)."""
    spec = json.loads(Path(file).read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(f"unsupported tokenizer in {file}: only byte-level BPE is supported, "
                         f"got model type {model.get('type')!r}")
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    special_ids = set(specials.values())
    try:   # a trained vocab may list the special tokens too: they stay special only
        ranks = {piece_to_bytes(piece): i for piece, i in model["vocab"].items()
                 if i not in special_ids}
    except KeyError as err:
        raise ValueError(f"unsupported tokenizer in {file}: vocab is not byte-level") from err
    if model.get("unk_token") and sum(len(t) == 1 for t in ranks) < 256:
        raise ValueError(f"unsupported tokenizer in {file}: single bytes are missing and map to an unknown token")
    return ranks, specials, split_pattern(spec.get("pre_tokenizer"), file), \
        uses_nfc(spec.get("normalizer"), file)


def split_pattern(pre: dict | None, file) -> str:
    """The split regex of a byte-level pre-tokenizer (Split + ByteLevel, or GPT-2 ByteLevel, with
    or without a Digits step first)."""
    pre = pre or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 2 and steps[0] == {"type": "Digits", "individual_digits": True} \
            and steps[1].get("type") == "ByteLevel" and steps[1].get("use_regex", True) \
            and not steps[1].get("add_prefix_space", True):
        return DIGITS_THEN_GPT2_PATTERN
    byte_level = steps[-1] if steps and steps[-1].get("type") == "ByteLevel" else None
    if byte_level and not byte_level.get("add_prefix_space", True):
        split = steps[0] if len(steps) == 2 else {}
        if split.get("type") == "Split" and "Regex" in split.get("pattern", {}) \
                and split.get("behavior") == "Isolated" and not split.get("invert") \
                and not byte_level.get("use_regex", True):
            return split["pattern"]["Regex"]
        if len(steps) == 1 and byte_level.get("use_regex", True):
            return GPT2_PATTERN
    raise ValueError(f"unsupported pre_tokenizer in {file}: {json.dumps(pre)[:200]}")


def uses_nfc(normalizer: dict | None, file) -> bool:
    if normalizer is None or normalizer.get("type") == "NFC":
        return normalizer is not None
    raise ValueError(f"unsupported normalizer in {file}: {normalizer.get('type')!r}")


def read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """tiktoken's format (Llama's original/tokenizer.model): one `base64(token) rank` per line."""
    lines = Path(file).read_text(encoding="ascii").splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in (l.split() for l in lines if l)}


def read_token_roles(folder: Path, specials: dict[str, int]) -> tuple[dict, list[int]]:
    """bos/eos/pad token texts and the stop ids, from the json files next to the tokenizer.

    tokenizer_config.json decides when it names a role (null means "none": Qwen has no BOS
    although its config.json has a bos_token_id); otherwise config.json, then
    generation_config.json. Every eos id found (eos may be a list) is a stop id."""
    def read(name):
        file = folder / name
        return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}

    def as_list(value):
        return value if isinstance(value, list) else [] if value is None else [value]

    tok_config, configs = read("tokenizer_config.json"), [read("config.json"),
                                                           read("generation_config.json")]
    text_of = {i: text for text, i in specials.items()}
    roles = {}
    for role in ("bos", "eos", "pad"):
        if f"{role}_token" in tok_config:
            value = tok_config[f"{role}_token"]
            text = value.get("content") if isinstance(value, dict) else value
        else:
            ids = [i for c in configs for i in as_list(c.get(f"{role}_token_id"))]
            text = text_of.get(ids[0]) if ids else None
        roles[f"{role}_token"] = text if text in specials else None
    stop_ids = [i for c in configs for i in as_list(c.get("eos_token_id")) if i in text_of]
    return roles, stop_ids


# --- the toy tokenizer -------------------------------------------------------------------------
TOY_PROMPT_WORDS = ["count", "from", "by", "repeat", "then", "and", "step", "times", "alternate", "with"]
TOY_WORDS = TOY_PROMPT_WORDS + [
    "the", "a", "is", "to", "of", "in", "up", "down", "sum", "list", "add", "next",   # glue
    "cat", "dog", "cow", "pig", "hen", "fox", "owl", "bee", "ant", "bat", "rat", "yak",  # animals
    "eel", "ape", "duck", "frog", "bird", "fish", "goat", "lion",
    "red", "blue", "green", "pink", "gray", "gold", "black", "white", "tan",            # colours
    "pie", "jam", "egg", "tea", "rice", "corn", "bean", "fig", "nut", "pea", "ham",     # foods
    "bun", "cake", "soup", "milk",
    "box", "cup", "pen", "hat", "key", "bag", "map", "car", "bus", "bed", "pot", "jar",  # objects
    "mug", "cap", "bell", "book", "ring", "lamp", "drum", "kite",
]
TOY_PUNCTUATION = [" :", " |", " ."]   # ":", "|", "." and "\n" are single bytes already


def toy_whole_tokens() -> list[str]:
    """Every string the toy vocabulary holds as ONE token (single bytes aside)."""
    numbers = [f"{n}" for n in range(1000)] + [f" {n}" for n in range(1000)]
    return numbers + [f" {w}" for w in TOY_WORDS] + TOY_PROMPT_WORDS + TOY_PUNCTUATION


def toy_tokenizer() -> Tokenizer:
    """A ~2.5k-token byte-level BPE for the toy tasks, built in code (no training).

    Ranks: the 256 bytes first, then every prefix of every whole token, shorter first.
    Whenever a piece's prefix is a token, BPE can always extend it by one byte, so each whole
    token is reachable by merges, and a piece that IS a whole token encodes to one id."""
    ranks = {bytes([b]): b for b in range(256)}
    prefixes = {t.encode()[:n] for t in toy_whole_tokens() for n in range(2, len(t.encode()) + 1)}
    for token in sorted(prefixes, key=lambda t: (len(t), t)):
        ranks[token] = len(ranks)
    specials = {text: len(ranks) + i for i, text in enumerate(["<|bos|>", "<|eos|>", "<|pad|>"])}
    return Tokenizer(ranks, specials, GPT2_PATTERN, bos_token="<|bos|>", eos_token="<|eos|>",
                     pad_token="<|pad|>")


# =============================================================================================
# Toy tasks
# =============================================================================================
#
# Four tasks, generated in code, small enough for a CPU transformer to learn in minutes. An
# answer is a list of items (one token each: a number or a word with its leading space; NUM_ITEMS
# of them except for count), then <|eos|>; a sequence is <|bos|> prompt answer <|eos|>.
#
#   task        prompt                               answer (one valid continuation)
#   count       count 17 18 19                       20 21 22 ... 32                          determined
#   repeat      repeat cat red pie cat red pie       cat red pie cat red pie ...              determined
#   count_free  count from 17                        18 19 20 ...  or  16 15 14 ...           BRANCHING
#   alternate   alternate the with cat red pie fox   the cat the cat ...  or  red the red ...  BRANCHING
#
# count and repeat answers carry on from the prompt: "count 17 18 19 20 21 ..." is one count and
# "repeat cat red pie cat red pie cat red pie ..." one pattern, so every answer token follows the
# same rule in the same context as the tokens before it (+1; the word 3 back), from the first one
# on. A count prompt shows 3 to 5 numbers, so "the start plus the answer position" is no
# shortcut: only "+1" works, and it carries over to start numbers never seen in a prompt. Every
# count is COUNT_LENGTH numbers long, the prompt's included (so its answer has 11 to 13); the
# repeat prompt shows its group twice, then the answer repeats it NUM_ITEMS / 3 more times.
#
# The two branching tasks are the two failures of naive multi-token prediction, built in
# on purpose:
#   count_free  the direction is free (up or down, equally likely) but once chosen it must be
#               kept. Trained on ground truth, the prediction j ahead is a 50/50 mixture of
#               a+j and a-j, so the argmax at each position picks a branch on its own, e.g.
#               "18 15 20 13": an incoherent mixture.
#   alternate   alternate the glue word "the" with ONE of the prompt's four words. 40% of the
#               answers start with "the", and then the first word always follows: "the cat
#               the cat"; the other 60% start with a word, any of the four (15% each), and
#               "the" follows: "red the red the". "the" is the most frequent item at EVERY
#               position (40% against 15% at even positions, 60% against 40% at odd ones),
#               so the ground-truth marginal's argmax is "the the the the": far-future
#               collapse onto the most frequent token, the classic example. Greedy
#               decoding of the conditionals has a clear favourite at the one real choice
#               ("the" first: 40% against 15%) and gives "the cat the cat".
# A teacher decoding one token at a time never mixes branches: after "17 16" it counts down.
# alternate needs only copies and the identity of one fixed word, and its word tuples are so many
# that no two prompts repeat: a model cannot memorize it prompt by prompt and must learn the rule,
# which then holds on held-out tuples. (Two earlier designs taught us this, README: a number
# version, "step up and down from 17", was learned start by start and broke on held-out starts;
# a version whose glue was a prompt word, "alternate cat with red pie ...", needed a comparison
# of the answer's first word with the prompt that the students' mask slots did not learn.)
#
# Checkers score an output three ways: `accuracy` (exactly right; for a branching task: a valid
# answer of the right length), `coherence` (obeys the task's rule, length aside) and
# `degenerate` (a run of DEGENERATE_RUN equal items, which no task allows: counts never stand
# still and repeated words always differ from their neighbours).
#
# Held-out evaluation: the prompt parameters ("key") are split by a fixed rule (start numbers,
# or a hash of the word tuple); training never samples a held-out key.

TOY_TASKS = ("count", "repeat", "count_free", "alternate")
BRANCHING_TASKS = ("count_free", "alternate")
NUM_ITEMS = 12                               # items in every answer but count's
COUNT_STARTS = range(12, 150)                # start numbers: every count stays within 0..164
COUNT_SHOWN = (3, 4, 5)                      # count: how many numbers the prompt shows
COUNT_LENGTH = 16                            # count: numbers in prompt + answer
DIRECTIONS = {"up": 1, "down": -1}           # count_free: either way, equally likely
REPEAT_GROUP = 3                             # repeat: words in the repeated group
ALTERNATE_GLUE = "the"                       # alternate: the word every answer alternates with
ALTERNATE_WORDS = 4                          # alternate: words in the prompt to pick the other one from
ALTERNATE_GLUE_FIRST = 0.4                   # alternate: how often the glue comes first (else a word)
DEGENERATE_RUN = 3                           # "the the the": this many equal items in a row
TOY_CONTENT_WORDS = TOY_WORDS[TOY_WORDS.index("cat"):]   # animals, colours, foods, objects


def start_heldout(task: str, start: int) -> bool:
    """One start number in five is held out: 13, 18, 23, ... for count, 15, 20, 25, ... for
    count_free. Every step a held-out prompt needs (13 -> 14 -> ...) is trained elsewhere."""
    return start % 5 == {"count": 3, "count_free": 0}[task]


def words_heldout(words: tuple) -> bool:
    """One word tuple in eight (by a fixed hash of the text, stable across runs) is held out."""
    return zlib.crc32(" ".join(words).encode()) % 8 == 0


def is_heldout(task: str, key: tuple) -> bool:
    """Whether a prompt's parameters belong to the evaluation split."""
    if task in ("count", "count_free"):
        return start_heldout(task, key[0])
    return words_heldout(key)


def sample_key(task: str, rng: random.Random) -> tuple:
    """Random prompt parameters: count (start, shown), count_free (start,), repeat and alternate (the words)."""
    if task == "count":
        return rng.choice(COUNT_STARTS), rng.choice(COUNT_SHOWN)
    if task == "count_free":
        return (rng.choice(COUNT_STARTS),)
    if task == "repeat":
        return tuple(rng.sample(TOY_CONTENT_WORDS, REPEAT_GROUP))
    if task == "alternate":
        return tuple(rng.sample(TOY_CONTENT_WORDS, ALTERNATE_WORDS))
    raise ValueError(f"unknown toy task {task!r}; tasks: {', '.join(TOY_TASKS)}")


def toy_prompt(task: str, key: tuple) -> str:
    if task == "count":
        return "count " + " ".join(str(key[0] + i) for i in range(key[1]))
    if task == "count_free":
        return f"count from {key[0]}"
    if task == "repeat":
        return "repeat " + " ".join(key + key)
    if task == "alternate":
        return f"alternate {ALTERNATE_GLUE} with " + " ".join(key)
    raise ValueError(f"unknown toy task {task!r}")


def counting(start: int, step: int, n: int = NUM_ITEMS) -> list[str]:
    """The n numbers after start, one step apart: start + step, start + 2 step, ..."""
    return [str(start + i * step) for i in range(1, n + 1)]


def toy_answer(task: str, key: tuple, rng: random.Random) -> list[str]:
    """One valid answer, as items; for a branching task the branch is drawn with rng."""
    if task == "count":
        return counting(key[0] + key[1] - 1, 1, COUNT_LENGTH - key[1])
    if task == "count_free":
        return counting(key[0], rng.choice(list(DIRECTIONS.values())))
    if task == "repeat":
        return [key[i % len(key)] for i in range(NUM_ITEMS)]
    if task == "alternate":
        pair = (ALTERNATE_GLUE, key[0]) if rng.random() < ALTERNATE_GLUE_FIRST else (rng.choice(key), ALTERNATE_GLUE)
        return [pair[i % 2] for i in range(NUM_ITEMS)]
    raise ValueError(f"unknown toy task {task!r}")


@dataclass(frozen=True)
class ToyExample:
    task: str
    key: tuple          # the prompt's parameters (what the held-out split is about)
    prompt: str         # e.g. "count 17 18 19"
    answer: str         # e.g. " 20 21 22 ..." (items with leading spaces)


def toy_example(task: str, rng: random.Random, split: str = "train") -> ToyExample:
    """A random example whose key lies in `split` ("train" or "heldout")."""
    want_heldout = {"train": False, "heldout": True}[split]
    key = sample_key(task, rng)
    while is_heldout(task, key) != want_heldout:
        key = sample_key(task, rng)
    answer = "".join(" " + item for item in toy_answer(task, key, rng))
    return ToyExample(task, key, toy_prompt(task, key), answer)


def encode_example(tokenizer, ex: ToyExample) -> tuple[list[int], list[int]]:
    """(prompt ids with <|bos|> in front, answer ids with <|eos|> at the end)."""
    return [tokenizer.bos_id] + tokenizer.encode(ex.prompt), tokenizer.encode(ex.answer) + [tokenizer.eos_id]


def toy_batch(tokenizer, rng: random.Random, batch_size: int, tasks=TOY_TASKS, seq_len: int | None = None,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of whole training sequences, tasks mixed uniformly, right-padded with <|pad|>.

    Returns (seqs (B, N) long, answer (B, N) bool: True on answer tokens, <|eos|> included).
    N = seq_len (sequences must fit) or the longest sequence in the batch."""
    pairs = [encode_example(tokenizer, toy_example(rng.choice(tasks), rng, split)) for _ in range(batch_size)]
    longest = max(len(p) + len(a) for p, a in pairs)
    N = seq_len or longest
    if longest > N:
        raise ValueError(f"a toy sequence of {longest} tokens does not fit seq_len={N}")
    pad = [[tokenizer.pad_id] * (N - len(p) - len(a)) for p, a in pairs]
    seqs = torch.tensor([p + a + z for (p, a), z in zip(pairs, pad)])                       # (B, N)
    answer = torch.tensor([[False] * len(p) + [True] * len(a) + [False] * len(z) for (p, a), z in zip(pairs, pad)])
    return seqs, answer


def heldout_examples(task: str, n: int, seed: int = 1234) -> list[ToyExample]:
    """n distinct held-out prompts of one task, the same for every run (fixed seed)."""
    rng, seen, out = random.Random(seed), set(), []
    for _ in range(100 * n):
        ex = toy_example(task, rng, "heldout")
        if ex.key not in seen:
            seen.add(ex.key)
            out.append(ex)
        if len(out) == n:
            break
    return out


# --- checkers ----------------------------------------------------------------------------------

@dataclass
class ToyScore:
    accuracy: bool      # exactly right (branching: a valid answer of the right length)
    coherence: bool     # obeys the rule (length aside)
    degenerate: bool    # DEGENERATE_RUN equal items in a row


def has_run(items: list[str], run: int = DEGENERATE_RUN) -> bool:
    """True if some item repeats `run` times in a row ("the the the", "20 20 20")."""
    streak = 1
    for prev, item in zip(items, items[1:]):
        streak = streak + 1 if item == prev else 1
        if streak >= run:
            return True
    return False


def as_numbers(items: list[str]) -> list[int] | None:
    return [int(x) for x in items] if items and all(x.isdigit() for x in items) else None


def follows_rule(task: str, key: tuple, items: list[str]) -> bool:
    """The task's rule, checked on the generated items (at least two of them)."""
    if len(items) < 2:
        return False
    if task in ("count", "count_free"):
        nums = as_numbers(items)
        if nums is None:
            return False
        last = key[0] + key[1] - 1 if task == "count" else key[0]      # the prompt's last number
        step = 1 if task == "count" else nums[0] - last
        return step in DIRECTIONS.values() and all(b - a == step for a, b in zip([last] + nums, nums))
    if task == "repeat":
        return all(item == key[i % len(key)] for i, item in enumerate(items))
    if task == "alternate":                                             # a pair the generator can draw
        pair = (items[0], items[1])
        if pair != (ALTERNATE_GLUE, key[0]) and not (pair[0] in key and pair[1] == ALTERNATE_GLUE):
            return False
        return all(item == pair[i % 2] for i, item in enumerate(items))
    raise ValueError(f"unknown toy task {task!r}")


def check_toy(task: str, key: tuple, output: str, stopped: bool = True) -> ToyScore:
    """Score a generated answer (text without <|eos|>; `stopped`: the model did emit <|eos|>)."""
    items = output.split()
    coherent = follows_rule(task, key, items)
    if task in BRANCHING_TASKS:
        accurate = coherent and len(items) == NUM_ITEMS
    else:
        accurate = items == toy_answer(task, key, random.Random(0))
    return ToyScore(accuracy=accurate and stopped, coherence=coherent, degenerate=has_run(items))


# =============================================================================================
# MTP training layout
# =============================================================================================
#
# A training sequence of N ground-truth tokens becomes ONE packed sequence that holds M
# independent MTP problems ("regions"). Region r has a prefix that ends at original index
# e_r; right after that token we insert k-1 <mask> slots, then the ground truth continues.
# The k predictions of region r are read at the last prefix token (ordinary next-token
# prediction, j = 0) and at the k-1 slots (j = 1..k-1); prediction j stands for original
# token e_r + 1 + j. The ground-truth tokens the slots stand in for are not removed: they
# follow the block as "copies" at their ORIGINAL positions, so the next region's prefix is
# complete and every ground-truth token sees exactly its ordinary causal context.
#
# Region boundaries. The sequence is cut into M regions of R = N // M tokens (the paper uses
# M = N / (2 k_max), so R = 2 k_max). The offset o in [0, R) shifts all of them together:
#     e_r = o + r * R            (r = 0..M-1; always <= N - 1)
# Region r owns the ground truth (e_r, e_{r+1}], the stretch its predictions are about; the
# tokens 0..e_0 before the first mask block belong to no region (they are only context).
# With the paper's M, R >= 2 k_max >= 2 k, so a window e_r+1 .. e_r+k never reaches the next
# prefix end (a smaller R still works: the blocks are independent, only denser).
#
# EOS. Let x_E be the first EOS at index E >= 1 (index 0 is never a target, and Qwen data
# starts with its end-of-text token). Region r is supervised iff e_r < E, so the last
# supervised region is the one whose stretch (e_r, e_{r+1}] contains the EOS, and no region
# predicts from a prefix that already contains it. Targets after the EOS are EOS. Everything
# after that (ground truth beyond E, mask blocks of later regions) is padding: pad id, no
# loss, nobody attends to it, and it attends only to itself so every softmax row is defined.
# A prediction whose target index runs past N - 1 is unsupervised unless the row had an EOS
# (then its target is known: EOS). All rows share one packed length L = N + M (k - 1);
# position ids go up to N + k - 2, which must stay below the model's max_seq_len.

GT, MASK, COPY, PAD = 0, 1, 2, 3   # token kinds in the packed layout (COPY = ground truth after a block)
KIND_LETTER = "GMCP"


@dataclass
class MTPBatch:
    """Everything one MTP training step needs, for B rows packed to length L (M regions, k predictions)."""
    input_ids: torch.Tensor     # (B, L) long: ground truth, k-1 mask slots after each prefix end, pad
    positions: torch.Tensor     # (B, L) long: original index of every ground-truth token; slot j -> e_r + j
    attn_mask: torch.Tensor     # (B, L, L) bool, True = query (row) may attend to key (column)
    kind: torch.Tensor          # (B, L) long: GT / MASK / COPY / PAD
    pred_index: torch.Tensor    # (B, M, k) long: packed index of prediction j of region r
    targets: torch.Tensor       # (B, M, k) long: ground-truth token prediction j should produce
    valid: torch.Tensor         # (B, M, k) bool: prediction is supervised
    ntp_index: torch.Tensor     # (B, N-1) long: packed index of ground-truth tokens 0..N-2
    ntp_targets: torch.Tensor   # (B, N-1) long: the next ground-truth token (tokens 1..N-1)
    ntp_valid: torch.Tensor     # (B, N-1) bool: next token is real (not after the EOS)
    prefix_end: torch.Tensor    # (M,) long: original index e_r of each region's last prefix token
    k: int
    offset: int
    region_len: int

    def to(self, device) -> "MTPBatch":
        moved = {f: getattr(self, f) for f in self.__dataclass_fields__}
        return MTPBatch(**{f: v.to(device) if torch.is_tensor(v) else v for f, v in moved.items()})


def default_n_regions(seq_len: int, k_max: int) -> int:
    """The paper's choice M = N / (2 k_max): regions twice as long as the longest window."""
    return max(1, seq_len // (2 * k_max))


def sample_k_and_offset(k_max: int, region_len: int, generator: torch.Generator | None = None,
                        k_min: int = 2) -> tuple[int, int]:
    """Draw k uniformly in [k_min, k_max] and, INDEPENDENTLY, the region offset in [0, region_len)."""
    k = int(torch.randint(k_min, k_max + 1, (1,), generator=generator))
    offset = int(torch.randint(0, region_len, (1,), generator=generator))
    return k, offset


def region_prefix_ends(seq_len: int, n_regions: int, offset: int) -> torch.Tensor:
    """Original index e_r = offset + r * R of the last prefix token of each region -> (M,)."""
    region_len = seq_len // n_regions
    if not (n_regions >= 1 and region_len >= 1 and 0 <= offset < region_len):
        raise ValueError(f"need 1 <= n_regions <= seq_len and 0 <= offset < {region_len}, "
                         f"got n_regions={n_regions}, offset={offset}, seq_len={seq_len}")
    return offset + region_len * torch.arange(n_regions)


def first_eos(seqs: torch.Tensor, eos_id) -> torch.Tensor:
    """Index E >= 1 of the first EOS in each row, or N when the row has none -> (B,)."""
    B, N = seqs.shape
    if eos_id is None:
        return torch.full((B,), N, dtype=torch.long, device=seqs.device)
    ids = torch.as_tensor(eos_id, device=seqs.device).reshape(-1)
    is_eos = (seqs[..., None] == ids).any(-1)                     # (B, N)
    is_eos[:, 0] = False                                          # index 0 is never a target
    idx = torch.arange(N, device=seqs.device).expand(B, N)
    return torch.where(is_eos, idx, N).min(1).values


def block_causal_mask(gt_pos, slot_pos, prefix_end, L) -> torch.Tensor:
    """The (L, L) attention pattern shared by all rows (padding is applied per row later).

    A ground-truth query sees the ground-truth keys up to its own original index; a slot of
    region r sees the ground-truth keys up to e_r plus the slots of its own block up to itself.
    """
    M, S = slot_pos.shape
    N = gt_pos.numel()
    device = gt_pos.device
    orig = torch.full((L,), L, dtype=torch.long, device=device)   # original index of ground-truth keys
    orig[gt_pos] = torch.arange(N, device=device)
    context_end = orig.clone()                                    # last ground-truth index each query may see
    context_end[slot_pos] = prefix_end[:, None].expand(M, S)
    block = torch.full((L,), -1, dtype=torch.long, device=device) # region of each mask slot, -1 elsewhere
    block[slot_pos] = torch.arange(M, device=device)[:, None].expand(M, S)
    is_gt = block < 0
    sees_gt = is_gt[None, :] & (orig[None, :] <= context_end[:, None])              # (L query, L key)
    idx = torch.arange(L, device=device)
    own_block = (block[:, None] == block[None, :]) & ~is_gt[:, None] & (idx[None, :] <= idx[:, None])
    return sees_gt | own_block


def mtp_layout(seqs: torch.Tensor, k: int, offset: int, n_regions: int, mask_id: int,
               eos_id=None, pad_id: int = 0, trained: torch.Tensor | None = None) -> MTPBatch:
    """Pack a batch of ground-truth sequences (B, N) into M MTP problems per row.

    `eos_id` may be an int, a list of ints (any of them ends a row) or None. `trained` (B, N)
    bool, optional: the tokens that may be targets (e.g. answers, not prompts); a prediction
    past the EOS is about the EOS. Worked example,
    N = 12, k = 3, two regions (region length R = 6), offset 2, so the prefix ends are e = (2, 8);
    tokens a..l, M = mask slot, G/M/C = ground truth / mask / copy, `r.j` = prediction j of
    region r and the token it must produce (print it yourself with `layout_table`):

        idx       0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
        token     a   b   c   M   M   d   e   f   g   h   i   M   M   j   k   l
        pos       0   1   2   3   4   3   4   5   6   7   8   9  10   9  10  11
        kind      G   G   G   M   M   C   C   G   G   G   G   M   M   C   C   G
        pred            0.0 0.1 0.2                     1.0 1.1 1.2
        target            d   e   f                       j   k   l

    Slot 3 (position 3) sees a b c and itself; slot 4 sees a b c, slot 3 and itself; token d
    at index 5 sees a b c d only (it skips the block, as every ground-truth token does).
    """
    B, N = seqs.shape
    device = seqs.device
    S = k - 1                                                     # mask slots per region
    M = n_regions
    ends = region_prefix_ends(N, M, offset).to(device)            # (M,)
    L = N + M * S
    steps = torch.arange(N, device=device)
    # Where everything lands in the packed sequence (the same for every row):
    # ground-truth token i moves right by S for every block inserted before it.
    gt_pos = steps + S * (steps[:, None] > ends[None, :]).sum(1)                  # (N,)
    first_pred = ends + S * torch.arange(M, device=device)                        # (M,) = gt_pos[ends]
    pred_index = first_pred[:, None] + torch.arange(k, device=device)             # (M, k)
    slot_pos = pred_index[:, 1:]                                                  # (M, S)
    slot_j = torch.arange(1, k, device=device)                                    # (S,)

    input_ids = torch.full((B, L), mask_id, dtype=torch.long, device=device)
    input_ids[:, gt_pos] = seqs
    positions = torch.zeros(L, dtype=torch.long, device=device)
    positions[gt_pos] = steps                                     # copies keep their original positions
    positions[slot_pos] = ends[:, None] + slot_j                  # slot j stands in for token e_r + j
    kind = torch.full((L,), GT, dtype=torch.long, device=device)
    kind[slot_pos] = MASK
    copied = ends[:, None] + slot_j                               # (M, S) originals of the slots
    kind[gt_pos[copied[copied < N]]] = COPY

    # Targets: prediction j of region r is about original token e_r + 1 + j.
    E = first_eos(seqs, eos_id)                                   # (B,)
    has_eos = E < N
    target_idx = ends[:, None] + 1 + torch.arange(k, device=device)               # (M, k)
    flat_idx = target_idx.clamp(max=N - 1).reshape(1, M * k).expand(B, -1)
    targets = seqs.gather(1, flat_idx).view(B, M, k)
    eos_tok = seqs.gather(1, E.clamp(max=N - 1)[:, None])                         # (B, 1)
    after_eos = (target_idx[None] > E[:, None, None]) & has_eos[:, None, None]     # (B, M, k)
    targets = torch.where(after_eos, eos_tok[:, :, None], targets)
    supervised_region = ends[None, :] < E[:, None]                                # (B, M)
    known = (target_idx[None] < N) | has_eos[:, None, None]
    valid = supervised_region[:, :, None] & known
    ntp_valid = steps[None, 1:] <= E[:, None]
    if trained is not None:
        at = torch.minimum(target_idx[None], E.clamp(max=N - 1)[:, None, None]).reshape(B, M * k)
        valid = valid & trained.gather(1, at).view(B, M, k)
        ntp_valid = ntp_valid & trained[:, 1:]

    # Padding: ground truth after the EOS and the blocks of unsupervised regions.
    is_pad = torch.zeros(B, L, dtype=torch.bool, device=device)
    is_pad[:, gt_pos] = steps[None, :] > E[:, None]
    is_pad[:, slot_pos.reshape(-1)] = (~supervised_region)[:, :, None].expand(B, M, S).reshape(B, M * S)
    input_ids = torch.where(is_pad, pad_id, input_ids)

    base = block_causal_mask(gt_pos, slot_pos, ends, L)                           # (L, L)
    attn_mask = base[None] & ~is_pad[:, None, :] & ~is_pad[:, :, None]            # (B, L, L)
    attn_mask |= torch.eye(L, dtype=torch.bool, device=device)[None] & is_pad[:, :, None]

    return MTPBatch(
        input_ids=input_ids,
        positions=positions[None].expand(B, L).contiguous(),
        attn_mask=attn_mask,
        kind=torch.where(is_pad, PAD, kind[None]),
        pred_index=pred_index[None].expand(B, M, k).contiguous(),
        targets=targets,
        valid=valid,
        ntp_index=gt_pos[None, :-1].expand(B, N - 1).contiguous(),
        ntp_targets=seqs[:, 1:],
        ntp_valid=ntp_valid,
        prefix_end=ends,
        k=k, offset=offset, region_len=N // M,
    )


def random_mtp_layout(seqs: torch.Tensor, k_max: int, mask_id: int, eos_id=None, pad_id: int = 0,
                      n_regions: int | None = None, generator: torch.Generator | None = None,
                      trained: torch.Tensor | None = None) -> MTPBatch:
    """One training step's layout: the paper's M regions, k and offset drawn independently."""
    n_regions = n_regions or default_n_regions(seqs.shape[1], k_max)
    k, offset = sample_k_and_offset(k_max, seqs.shape[1] // n_regions, generator)
    return mtp_layout(seqs, k, offset, n_regions, mask_id, eos_id, pad_id, trained)


def layout_table(batch: MTPBatch, row: int = 0, token_str=str) -> str:
    """The packed row as a small text table: token, position, kind and which slots are predicted."""
    ids, pos, kind = batch.input_ids[row].tolist(), batch.positions[row].tolist(), batch.kind[row].tolist()
    L = len(ids)
    pred, target = [""] * L, [""] * L
    for r, (idx_r, tgt_r, ok_r) in enumerate(zip(batch.pred_index[row].tolist(),
                                                 batch.targets[row].tolist(), batch.valid[row].tolist())):
        for j, (i, t, ok) in enumerate(zip(idx_r, tgt_r, ok_r)):
            pred[i], target[i] = f"{r}.{j}", token_str(t) if ok else "-"
    cells = {
        "idx": [str(i) for i in range(L)],
        "token": ["M" if c == MASK else "P" if c == PAD else token_str(t) for t, c in zip(ids, kind)],
        "pos": [str(p) for p in pos],
        "kind": [KIND_LETTER[c] for c in kind],
        "pred": pred,
        "target": target,
    }
    width = max(len(c) for col in cells.values() for c in col) + 1
    return "\n".join(f"{name:<7}" + "".join(c.rjust(width) for c in col) for name, col in cells.items())


def plot_attention_mask(batch: MTPBatch, path, row: int = 0, token_str=str):
    """Save the (L, L) attention mask of one row as a PNG, cells coloured by the key's kind."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure                          # no pyplot: no global backend state
    from matplotlib.patches import Patch

    colours = ["#3b75af", "#ef8636", "#519e3e", "#b0b0b0"]       # GT, MASK, COPY, PAD
    mask, kind = batch.attn_mask[row].cpu(), batch.kind[row].cpu()
    L = mask.shape[0]
    image = torch.where(mask, kind[None, :].expand(L, L), -1).float()
    image[image < 0] = float("nan")                               # not attended: blank
    fig = Figure(figsize=(2 + 0.28 * L, 1.5 + 0.28 * L))
    ax = fig.add_subplot()
    ax.imshow(image.numpy(), cmap=ListedColormap(colours), vmin=-0.5, vmax=3.5, interpolation="nearest")
    labels = [("M" if c == MASK else "P" if c == PAD else token_str(t)) + f" @{p}"
              for t, p, c in zip(batch.input_ids[row].tolist(), batch.positions[row].tolist(), kind.tolist())]
    ax.set_xticks(range(L), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(L), labels, fontsize=7)
    for ticks in (ax.get_xticklabels(), ax.get_yticklabels()):
        for tick, c in zip(ticks, kind.tolist()):
            tick.set_color(colours[c])
    ax.set_xlabel("key (token @ position)")
    ax.set_ylabel("query")
    ax.set_title(f"MTP attention mask: k={batch.k}, offset={batch.offset}, {len(batch.prefix_end)} regions")
    names = ["ground truth", "mask slot", "copy", "padding"]
    ax.legend(handles=[Patch(color=c, label=n) for c, n in zip(colours, names)],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


# =============================================================================================
# Prompt formats
# =============================================================================================
#
# How finetune_hf.py turns a (prompt, response) pair into token ids, one format per model family:
#
#   llama3-chat  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>
#                <|start_header_id|>assistant<|end_header_id|>\n\n{response}<|eot_id|>
#                (Llama-3's template without a system turn; Llama-Magpie in the paper)
#   chatml       <|im_start|>system\n{CHATML_SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n
#                <|im_start|>assistant\n{response}<|im_end|>   (SmolLM2-Instruct, Qwen-Instruct)
#   qwen         <|endoftext|>{prompt}\n\n{response}<eos>   (the paper's Qwen recipe: prompt and
#                response joined with "\n\n", token 151643 = <|endoftext|> prepended)
#   plain        <bos>{prompt}\n\n{response}<eos>             (small models with no chat tokens)
#
# The prompt part and the response part are tokenized separately, so a prompt formatted for
# generation (finetune_hf.py eval --prompt-style zeroshot, analyze) is token for token the
# prefix seen in training. Sequences are cut to seq_len tokens and padded with `padding_token`:
# everything from its first occurrence on is padding for the layout (mtp_layout's EOS rule).
# A chat template tokenizes the text between special tokens piece by piece, so building the
# prompt piece by piece gives the very ids that transformers' apply_chat_template gives.

FORMATS = ("llama3-chat", "chatml", "qwen", "plain")
# The system turn SmolLM2-Instruct's chat template writes when a conversation has none.
CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def end_token(tok: Tokenizer, fmt: str) -> int:
    """The token that ends a response in this format (and pads after it)."""
    if fmt == "llama3-chat":
        return tok.token_id("<|eot_id|>")
    if fmt == "chatml":
        return tok.token_id("<|im_end|>")
    if tok.eos_id is None:
        raise ValueError("the tokenizer has no EOS token; give it one (tokenizer_config.json eos_token)")
    return tok.eos_id


def start_tokens(tok: Tokenizer, fmt: str) -> list[int]:
    """What every sequence of this format starts with (also put before few-shot eval prompts)."""
    if fmt == "llama3-chat":
        return [tok.token_id("<|begin_of_text|>")]
    if fmt == "qwen":
        return [tok.token_id("<|endoftext|>")]
    if fmt == "plain":
        return [tok.bos_id] if tok.bos_id is not None else []
    if fmt == "chatml":
        return []
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def prompt_tokens(tok: Tokenizer, fmt: str, prompt: str) -> list[int]:
    """A formatted prompt, up to where the response starts."""
    if fmt == "llama3-chat":
        def header(role):
            return [tok.token_id("<|start_header_id|>"), *tok.encode(role), tok.token_id("<|end_header_id|>"),
                    *tok.encode("\n\n")]
        return [*start_tokens(tok, fmt), *header("user"), *tok.encode(prompt.strip()),
                tok.token_id("<|eot_id|>"), *header("assistant")]
    if fmt == "chatml":
        start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
        return [start, *tok.encode(f"system\n{CHATML_SYSTEM}"), end, *tok.encode("\n"),
                start, *tok.encode(f"user\n{prompt}"), end, *tok.encode("\n"), start, *tok.encode("assistant\n")]
    return start_tokens(tok, fmt) + tok.encode(prompt + "\n\n")


def padding_token(tok: Tokenizer, fmt: str) -> int:
    """Fills a sequence after its response. The layout's EOS rule treats the first one as the end
    of the row, so for the chat templates it must not be the end-of-turn token, which also closes
    the user turn: there it is <|end_of_text|> (Llama 3) or <|endoftext|> (ChatML)."""
    if fmt in ("llama3-chat", "chatml"):
        return tok.token_id("<|end_of_text|>" if fmt == "llama3-chat" else "<|endoftext|>")
    return end_token(tok, fmt)


def response_tokens(tok: Tokenizer, fmt: str, response: str) -> list[int]:
    text = response.strip() if fmt == "llama3-chat" else response
    return tok.encode(text) + [end_token(tok, fmt)]


def training_sequences(pairs, tok: Tokenizer, fmt: str, seq_len: int) -> torch.Tensor:
    """Formatted, cut and padded pairs -> (n_rows, seq_len) int32."""
    out = torch.full((len(pairs), seq_len), padding_token(tok, fmt), dtype=torch.int32)
    for i, (prompt, response) in enumerate(pairs):
        ids = (prompt_tokens(tok, fmt, prompt) + response_tokens(tok, fmt, response))[:seq_len]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


# =============================================================================================
# Word problems
# =============================================================================================
#
# A miniature GSM8K that a CPU can learn: grade-school arithmetic word problems built from a
# few templates, each with a short chain of thought and an integer answer. They are written in
# the formats of the real datasets, so the loaders, prompt formats and scoring that serve
# MetaMathQA and GSM8K (finetune_hf.py) serve these unchanged:
#
#   training rows, MetaMathQA:  {"query", "response", "type", "original_question"}, the response
#                               ending "The answer is: N" (MetaMathQA's GSM rows do the same);
#   test rows, GSM8K:           {"question", "answer"}, the answer with GSM8K's calculator notes
#                               "12 + 7 = <<12+7=19>>19" and a last line "#### N".
#
# Reasoning is a list of text pieces and Equation(a, op, b); only the rendering differs between
# the two formats. Every template has ONE phrasing, so the solution is a deterministic function
# of the question (unlike MetaMathQA, whose answers vary in wording): the teacher is sure of
# everything but the results of the arithmetic, the part a small model gets wrong. Numbers
# stay small (results below 60, one-digit factors) so a model of a million parameters learns
# the arithmetic in minutes.

WP_NAMES = ["Tom", "Ann", "Ben", "Sue", "Max", "Amy", "Sam", "Eva", "Leo", "Mia", "Joe", "Kim"]
WP_ITEMS = ["apples", "pens", "books", "cards", "eggs", "cups", "toys", "coins", "shells", "stamps"]


@dataclass(frozen=True)
class Equation:
    a: int
    op: str          # "+", "-" or "*"
    b: int

    @property
    def value(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]


@dataclass
class WordProblem:
    question: str
    reasoning: list           # str pieces and Equations, rendered by `solution`
    answer: int


def _gets_more(rng) -> WordProblem:
    name, other, item = *rng.sample(WP_NAMES, 2), rng.choice(WP_ITEMS)
    a, b = rng.randint(2, 30), rng.randint(2, 20)
    eq = Equation(a, "+", b)
    return WordProblem(
        f"{name} has {a} {item}. {other} gives {name} {b} more {item}. How many {item} does {name} have now?",
        [f"{name} starts with {a} {item} and gets {b} more, so {name} has ", eq, f" {item}."], eq.value)


def _gives_away(rng) -> WordProblem:
    name, other, item = *rng.sample(WP_NAMES, 2), rng.choice(WP_ITEMS)
    a = rng.randint(10, 40)
    b = rng.randint(1, a - 1)
    eq = Equation(a, "-", b)
    return WordProblem(
        f"{name} has {a} {item}. {name} gives {b} {item} to {other}. How many {item} does {name} have left?",
        [f"{name} starts with {a} {item} and gives away {b}, so {name} has ", eq, f" {item} left."], eq.value)


def _boxes(rng) -> WordProblem:
    name, item = rng.choice(WP_NAMES), rng.choice(WP_ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    eq = Equation(a, "*", b)
    return WordProblem(
        f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does {name} buy?",
        [f"Each of the {a} boxes holds {b} {item}, so {name} buys ", eq, f" {item}."], eq.value)


def _buys_then_gives(rng) -> WordProblem:
    name, other, item = *rng.sample(WP_NAMES, 2), rng.choice(WP_ITEMS)
    a, b = rng.randint(2, 25), rng.randint(2, 15)
    first = Equation(a, "+", b)
    c = rng.randint(1, first.value - 1)
    second = Equation(first.value, "-", c)
    return WordProblem(
        f"{name} has {a} {item}. {name} buys {b} more {item} and then gives {c} {item} to {other}. "
        f"How many {item} does {name} have now?",
        [f"After buying {b} more, {name} has ", first, f" {item}. After giving {c} to {other}, {name} has ",
         second, f" {item}."], second.value)


def _money_left(rng) -> WordProblem:
    name, item = rng.choice(WP_NAMES), rng.choice(WP_ITEMS)
    n, price = rng.randint(2, 6), rng.randint(2, 6)
    cost = Equation(n, "*", price)
    money = rng.randint(cost.value + 1, cost.value + 25)
    left = Equation(money, "-", cost.value)
    return WordProblem(
        f"{name} has ${money}. {name} buys {n} {item} for ${price} each. How much money does {name} have left?",
        [f"The {item} cost ", cost, f" dollars. {name} has ", left, " dollars left."], left.value)


WP_TEMPLATES = [_gets_more, _gives_away, _boxes, _buys_then_gives, _money_left]


def word_problem(rng: random.Random) -> WordProblem:
    """One problem from a random template."""
    return rng.choice(WP_TEMPLATES)(rng)


def solution(problem: WordProblem, calculator_notes: bool = False) -> str:
    """The chain of thought as text; GSM8K style writes `a op b = <<a op b=c>>c`."""
    out = []
    for piece in problem.reasoning:
        if isinstance(piece, Equation):
            c = piece.value
            note = f"<<{piece.a}{piece.op}{piece.b}={c}>>" if calculator_notes else ""
            out.append(f"{piece.a} {piece.op} {piece.b} = {note}{c}")
        else:
            out.append(piece)
    return "".join(out)


def metamath_row(problem: WordProblem) -> dict:
    return {"query": problem.question, "response": f"{solution(problem)} The answer is: {problem.answer}",
            "type": "GSM_Synthetic", "original_question": problem.question}


def gsm8k_row(problem: WordProblem) -> dict:
    return {"question": problem.question, "answer": f"{solution(problem, calculator_notes=True)}\n#### {problem.answer}"}


def word_problem_split(n_train: int, n_test: int, seed: int = 0) -> tuple[list[WordProblem], list[WordProblem]]:
    """Disjoint training and test problems (no test question occurs in training)."""
    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < n_train + n_test:
        p = word_problem(rng)
        if p.question not in seen:
            seen.add(p.question)
            problems.append(p)
    return problems[:n_train], problems[n_train:]


def write_word_problems(folder, n_train: int = 20000, n_test: int = 500, seed: int = 0) -> tuple[Path, Path]:
    """train.json (MetaMathQA: one JSON array, as distributed) and test.jsonl (GSM8K: JSON lines)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, test = word_problem_split(n_train, n_test, seed)
    train_file, test_file = folder / "train.json", folder / "test.jsonl"
    train_file.write_text(json.dumps([metamath_row(p) for p in train], indent=1) + "\n", encoding="utf-8")
    test_file.write_text("".join(json.dumps(gsm8k_row(p)) + "\n" for p in test), encoding="utf-8")
    return train_file, test_file


def word_problem_pairs(path) -> list[tuple[str, str]]:
    """(query, response) pairs of a train.json written by write_word_problems."""
    with open(path, encoding="utf-8") as f:
        return [(row["query"], row["response"]) for row in json.load(f)]


def word_problem_batch(tokenizer, pairs, rng: random.Random, batch_size: int, seq_len: int):
    """A random batch for next-token pretraining, in the "plain" prompt format:
    <bos>{query}\n\n{response}<eos>, cut to seq_len and padded with <eos>.

    Returns (seqs, supervised), both (batch_size, seq_len): token ids, and which tokens are
    predicted (everything after <bos> up to and including the first <eos>).
    """
    rows = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
    seqs = training_sequences(rows, tokenizer, "plain", seq_len).long()               # (B, seq_len)
    is_eos = seqs == tokenizer.eos_id
    length = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, seq_len)         # (B,) through the first <eos>
    supervised = torch.arange(seq_len)[None, :] < length[:, None]
    supervised[:, 0] = False                                                          # <bos> is given, not predicted
    return seqs, supervised


def word_problem_tokenizer() -> Tokenizer:
    """A word-level byte-level BPE for the word problems, built in code like `toy_tokenizer`.

    Every piece the templates produce (GPT-2 split: a word with its leading space, a number, a
    punctuation run) is one token, and so is every number below 1000 with and without a leading
    space: about 2.5k tokens, so a problem with its solution takes 30-65 tokens. Other text
    still encodes, byte by byte. Ranks: the 256 bytes, then every prefix of every whole piece,
    shorter first, so BPE merges always reach the whole piece.
    """
    sample = word_problem_split(3000, 0, seed=12345)[0]
    text = "\n\n".join(f"{p.question}\n\n{metamath_row(p)['response']}" for p in sample)
    words = WP_NAMES + WP_ITEMS
    pieces = set(regex.findall(GPT2_PATTERN, text)) | set(words) | {f" {w}" for w in words}
    pieces |= {f"{n}" for n in range(1000)} | {f" {n}" for n in range(1000)}
    ranks = {bytes([b]): b for b in range(256)}
    prefixes = {p.encode()[:n] for p in pieces for n in range(2, len(p.encode()) + 1)}
    for token in sorted(prefixes, key=lambda t: (len(t), t)):
        ranks[token] = len(ranks)
    specials = {text: len(ranks) + i for i, text in enumerate(["<|bos|>", "<|eos|>", "<|pad|>"])}
    return Tokenizer(ranks, specials, GPT2_PATTERN, bos_token="<|bos|>", eos_token="<|eos|>",
                     pad_token="<|pad|>")


# =============================================================================================
# Domain prompts
# =============================================================================================
#
# Chat prompts of four kinds, generated from templates, for `finetune_hf.py data` (a model's
# own answers as training rows, when no data set is at hand) and `analyze` (how predictable
# is each kind of answer?). Every domain has a fixed train / test split of its prompts.

DOMAIN_TEMPLATES = {
    "lists": (["List {n} {x}.", "Name {n} {x}, one per line.", "Give me a numbered list of {n} {x}.",
               "What are {n} common {x}? Answer with a list."],
              ["animals", "fruits", "vegetables", "colors", "countries in Europe", "musical instruments",
               "sports", "birds", "flowers", "jobs", "kitchen tools", "board games", "programming languages",
               "farm animals", "ocean animals", "types of trees", "desserts", "breakfast foods", "hobbies",
               "school subjects", "car brands", "famous painters", "rivers", "things found in a park"]),
    "explanations": (["Explain what {x} is in two sentences.", "What is {x}? Answer briefly.",
                      "Describe how {x} works, in simple words.", "Why is {x} important? Answer in a few sentences."],
                     ["photosynthesis", "gravity", "a rainbow", "the internet", "a volcano", "democracy",
                      "the water cycle", "electricity", "a computer", "the moon", "a vaccine", "an earthquake",
                      "the heart", "a battery", "money", "a library", "recycling", "the weather", "sleep",
                      "a bicycle", "the sun", "friendship", "a map", "music"]),
    "writing": (["Write a short story about {x}.", "Write a short poem about {x}.",
                 "Write a paragraph describing {x}.", "Write a short letter to a friend about {x}."],
                ["a lost cat", "the ocean", "a rainy day", "a friendly robot", "a summer holiday", "a old tree",
                 "a busy city", "the first snow", "a birthday party", "a small village", "a dragon", "the stars",
                 "a train journey", "a garden", "a lighthouse", "a football match", "a new school", "the forest",
                 "a mountain", "a kind stranger", "a long night", "a river", "a baker", "a storm"]),
}
DOMAINS = ("word_problems", *DOMAIN_TEMPLATES)


def domain_prompts(domain: str, n: int, split: str = "train", seed: int = 0) -> list[str]:
    """Up to n prompts of one domain from its train or test part (a quarter of the subjects)."""
    if domain == "word_problems":             # the split write_word_problems makes (its test.jsonl)
        train, test = word_problem_split(20000, 500, seed)
        return [p.question for p in (train if split == "train" else test)][:n]
    if domain not in DOMAIN_TEMPLATES:
        raise ValueError(f"unknown domain {domain!r}; choose from {', '.join(DOMAINS)}")
    templates, subjects = DOMAIN_TEMPLATES[domain]
    subjects = [x for i, x in enumerate(subjects) if (i % 4 == 3) == (split == "test")]
    rng = random.Random(f"{domain}/{split}/{seed}")
    prompts = [t.format(n=n_items, x=x) for t in templates for x in subjects for n_items in (3, 5, 7, 10)
               if "{n}" in t or n_items == 3]
    rng.shuffle(prompts)
    return prompts[:n]
