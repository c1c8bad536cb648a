"""Tokenizers and prompt formats, support code a learner can skip.

Byte-level BPE over tiktoken, read from and written to Hugging Face tokenizer files
(tokenizer.json, tokenizer_config.json, Llama's original/tokenizer.model), and the prompt
formats that turn a (prompt, response) pair into token ids for each model family. The lessons
only call encode, decode and the format functions."""
import base64
import json
import unicodedata
from pathlib import Path

# tiktoken's dependency: the same regular expressions as its splitter
import regex
import tiktoken
import torch


# ============================== Tokenizers =============================
# Byte-level BPE: 256 single-byte tokens spell any UTF-8 text. A regex
# cuts text into pieces (a word with its leading space, a digit run, ...)
# that tokens never cross; inside a piece, BPE merges the adjacent pair
# forming the lowest-ranked token until none is left (tiktoken: rank = id;
# a piece that is a token is looked up whole). encode() never makes
# special tokens.
# Split patterns: Llama-3 groups digits in runs of up to three; Qwen2/3
# splits every digit.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# GPT-2's simpler pattern: a leading space attaches to a run of letters or
# of digits.
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+"""
                r"""| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
# SmolLM2 and StarCoder cut out every digit, then use GPT-2's pattern. As
# ONE pattern: a digit alone, no " 123" piece, and a whitespace run may
# end where a digit starts.
DIGITS_THEN_GPT2_PATTERN = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+"""
                            r"""| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+""")


class Tokenizer:
    """Byte-level BPE backed by tiktoken; reads and writes Hugging Face
    tokenizer files."""

    def __init__(self, mergeable_ranks: dict[bytes, int],
                 special_tokens: dict[str, int], pattern: str,
                 nfc: bool = False, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None):
        self.mergeable_ranks = dict(mergeable_ranks)
        self.special_tokens = dict(special_tokens)
        self.pattern = pattern
        self.nfc = nfc
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        # SmolLM2 lacks 21 single bytes: `tokenizers` drops them from each
        # piece (see encode()).
        self.missing_bytes = bytes(b for b in range(256)
                                   if bytes([b]) not in self.mergeable_ranks)
        self._enc = self._build(self.special_tokens)
        # ids that end generation
        self.stop_ids = [self.eos_id] if eos_token else []
        # set when read from Hugging Face files
        self.hf_spec = None
        self.chat_template = None

    def _build(self, specials: dict[str, int]) -> tiktoken.Encoding:
        """Check what tiktoken would not (it panics or silently misbehaves),
        then build it."""
        ids = [*self.mergeable_ranks.values(), *specials.values()]
        if len(set(ids)) != len(ids):
            raise ValueError("two tokens share an id (ordinary and special "
                             "ids must not overlap)")
        for role in (self.bos_token, self.eos_token, self.pad_token):
            if role is not None and role not in specials:
                raise ValueError(f"{role!r} is not a special token")
        return tiktoken.Encoding("bpe", pat_str=self.pattern,
                                 mergeable_ranks=self.mergeable_ranks,
                                 special_tokens=specials)

    def token_id(self, text: str) -> int:
        if text not in self.special_tokens:
            raise KeyError(f"{text!r} is not a special token of this tokenizer")
        return self.special_tokens[text]

    @property
    def n_vocab(self) -> int:
        """The largest id + 1 (ids may have gaps)."""
        return self._enc.n_vocab

    # The special tokens' ids by role; None: no such role.

    @property
    def bos_id(self) -> int | None:
        return self.special_tokens.get(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self.special_tokens.get(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        return self.special_tokens.get(self.pad_token)

    @property
    def mask_id(self) -> int | None:
        return self.special_tokens.get("<mask>")

    def encode(self, text: str) -> list[int]:
        """Ordinary text -> ids: no BOS added, special-token text is NOT
        parsed."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        raw = text.encode()
        if len(raw.translate(None, self.missing_bytes)) == len(raw):
            return self._enc.encode_ordinary(text)
        # rare: split, drop the bytes the vocab lacks from each piece, merge
        # what is left (tiktoken's BPE of one piece is a private method: its
        # public encode would split the piece again)
        pieces = regex.findall(self.pattern, text)
        kept = [p.encode().translate(None, self.missing_bytes) for p in pieces]
        return [i for piece in kept if piece
                for i in self._enc._encode_single_piece(piece)]

    def decode(self, ids) -> str:
        """Special ids decode to their text; bytes that are not valid UTF-8
        become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids) -> bytes:
        """The bytes of the ids (a token may hold part of a UTF-8 character)."""
        return self._enc.decode_bytes([int(i) for i in ids])

    def add_special_token(self, text: str, token_id: int | None = None) -> int:
        """Add a special token (default id: n_vocab) and rebuild the encoder;
        returns its id."""
        # already there, with the id asked for (or any id)
        if (text in self.special_tokens
                and token_id in (None, self.special_tokens[text])):
            return self.special_tokens[text]
        specials = {**self.special_tokens,
                    text: self.n_vocab if token_id is None else int(token_id)}
        # raises (and changes nothing) on an id clash
        self._enc = self._build(specials)
        self.special_tokens = specials
        return specials[text]

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """Load tokenizer.json or (Llama) original/tokenizer.model. Roles:
        tokenizer_config.json's (null: none; Qwen has no BOS), else config /
        generation_config ids, whose every eos id stops."""
        folder = Path(path)
        json_file = folder / "tokenizer.json"
        llama_model = folder / "original" / "tokenizer.model"
        spec = None
        roles = {}
        if json_file.is_file():
            spec = json.loads(json_file.read_text(encoding="utf-8-sig"))
            ranks, specials, pattern, nfc = read_hf_tokenizer_json(spec, json_file)
        elif llama_model.is_file():
            # tiktoken's format: one `base64(token) rank` per line
            text = llama_model.read_text(encoding="ascii")
            lines = [line.split() for line in text.splitlines() if line]
            ranks = {base64.b64decode(token): int(rank) for token, rank in lines}
            specials = llama3_special_tokens(max(ranks.values()) + 1)
            pattern = LLAMA3_PATTERN
            nfc = False
            # unless the config files name others
            roles = {"bos_token": "<|begin_of_text|>",
                     "eos_token": "<|end_of_text|>"}
        else:
            raise FileNotFoundError(f"no tokenizer.json or "
                                    f"original/tokenizer.model in {folder}")

        names = ("tokenizer_config.json", "config.json", "generation_config.json")
        files = [folder / name for name in names]
        tok_config, *configs = [json.loads(f.read_text("utf-8-sig")) if f.is_file() else {}
                                for f in files]

        def config_ids(key):
            # each file may give an id, a list of ids or null
            ids = []
            for config in configs:
                value = config.get(key)
                if isinstance(value, list):
                    ids += value
                elif value is not None:
                    ids.append(value)
            return ids

        text_of = {i: text for text, i in specials.items()}
        for role in ("bos_token", "eos_token", "pad_token"):
            first_id = next(iter(config_ids(f"{role}_id")), None)
            text = tok_config.get(role, text_of.get(first_id))
            # an AddedToken dict
            if isinstance(text, dict):
                text = text.get("content")
            roles[role] = text if text in specials else roles.get(role)

        tokenizer = cls(ranks, specials, pattern, nfc, **roles)
        stop_ids = [i for i in config_ids("eos_token_id") if i in text_of]
        tokenizer.stop_ids = list(dict.fromkeys(tokenizer.stop_ids + stop_ids))
        tokenizer.hf_spec = spec
        tokenizer.chat_template = tok_config.get("chat_template")
        return tokenizer

    def save_pretrained(self, path):
        """Write tokenizer.json + tokenizer_config.json (loadable by
        `tokenizers`/AutoTokenizer)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        roles = {"bos_token": self.bos_token,
                 "eos_token": self.eos_token,
                 "pad_token": self.pad_token,
                 "mask_token": "<mask>" if self.mask_id is not None else None,
                 "chat_template": self.chat_template or None}
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False,
                  **{key: value for key, value in roles.items() if value is not None}}
        files = [("tokenizer.json", hf_tokenizer_json(self), None),
                 ("tokenizer_config.json", config, 2)]
        for name, obj, indent in files:
            text = json.dumps(obj, indent=indent, ensure_ascii=False)
            (folder / name).write_text(text, "utf-8")


def whole_token_tokenizer(pieces) -> Tokenizer:
    """A byte-level BPE in which each of `pieces` is ONE token. Ranks: the
    256 bytes, then every prefix of every piece, shorter first, so merges
    grow a piece byte by byte."""
    prefixes = {p.encode()[:n] for p in pieces
                for n in range(2, len(p.encode()) + 1)}
    tokens = [bytes([b]) for b in range(256)]
    tokens += sorted(prefixes, key=lambda t: (len(t), t))
    ranks = {token: i for i, token in enumerate(tokens)}
    specials = {text: len(ranks) + i
                for i, text in enumerate(["<|bos|>", "<|eos|>", "<|pad|>"])}
    return Tokenizer(ranks, specials, GPT2_PATTERN, bos_token="<|bos|>",
                     eos_token="<|eos|>", pad_token="<|pad|>")


# ============================ Prompt formats ===========================
# How finetune_hf.py turns a (prompt, response) pair into token ids, one
# format per model family:
#   llama3-chat  <|begin_of_text|><|start_header_id|>user<|end_header_id|>
#                \n\n{prompt}<|eot_id|>
#                <|start_header_id|>assistant<|end_header_id|>
#                \n\n{response}<|eot_id|>
#   chatml       <|im_start|>system\n{CHATML_SYSTEM}<|im_end|>\n
#                <|im_start|>user\n{prompt}<|im_end|>\n
#                <|im_start|>assistant\n{response}<|im_end|>
#                (SmolLM2-Instruct, Qwen-Instruct)
#   qwen         <|endoftext|>{prompt}\n\n{response}<eos>
#                (the paper's Qwen recipe)
#   plain        <bos>{prompt}\n\n{response}<eos>
#                (small models with no chat tokens)
# Prompt and response are tokenized apart, as transformers'
# apply_chat_template does.
# The decoding commands (mtp/cli.py) also take "raw", which is no format: the
# text as given after the model's BOS, with no blank line for a response to
# follow. Their "auto" picks raw for a model without chat tokens, where
# finetune_hf.py's picks plain, the format it trains and scores such a model in.
FORMATS = ("llama3-chat", "chatml", "qwen", "plain")
# The system message SmolLM2-Instruct's chat template puts first when a
# conversation has none; with it, chatml prompts equal that template's tokens.
CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def default_format(tok: Tokenizer, model_type: str) -> str:
    """The prompt format this tokenizer was made for; plain if it has no
    chat tokens."""
    has = set(tok.special_tokens).issuperset
    if has({"<|start_header_id|>", "<|eot_id|>"}):
        return "llama3-chat"
    if model_type in ("qwen2", "qwen3") and has({"<|endoftext|>"}):
        return "qwen"
    if has({"<|im_start|>", "<|im_end|>", "<|endoftext|>"}):
        return "chatml"
    return "plain"


def start_tokens(tok: Tokenizer, fmt: str) -> list[int]:
    """What every sequence of this format starts with (also put before
    few-shot eval prompts)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; "
                         f"choose one of {', '.join(FORMATS)}")
    if fmt in ("llama3-chat", "qwen"):
        return [tok.token_id("<|begin_of_text|>" if fmt == "llama3-chat"
                             else "<|endoftext|>")]
    return [tok.bos_id] if fmt == "plain" and tok.bos_id is not None else []


def prompt_tokens(tok: Tokenizer, fmt: str, prompt: str) -> list[int]:
    """A formatted prompt, up to where the response starts."""
    if fmt == "llama3-chat":
        def header(role):
            return [tok.token_id("<|start_header_id|>"), *tok.encode(role),
                    tok.token_id("<|end_header_id|>"), *tok.encode("\n\n")]

        return [*start_tokens(tok, fmt),
                *header("user"), *tok.encode(prompt.strip()),
                tok.token_id("<|eot_id|>"),
                *header("assistant")]
    if fmt == "chatml":
        start = tok.token_id("<|im_start|>")
        end = tok.token_id("<|im_end|>")
        newline = tok.encode("\n")
        return [start, *tok.encode(f"system\n{CHATML_SYSTEM}"), end, *newline,
                start, *tok.encode(f"user\n{prompt}"), end, *newline,
                start, *tok.encode("assistant\n")]
    return start_tokens(tok, fmt) + tok.encode(prompt + "\n\n")


def end_token(tok: Tokenizer, fmt: str) -> int:
    if fmt in ("llama3-chat", "chatml"):
        return tok.token_id("<|eot_id|>" if fmt == "llama3-chat" else "<|im_end|>")
    if tok.eos_id is None:
        raise ValueError("the tokenizer has no EOS token; give it one "
                         "(tokenizer_config.json eos_token)")
    return tok.eos_id


def response_tokens(tok: Tokenizer, fmt: str, response: str) -> list[int]:
    if fmt == "llama3-chat":
        response = response.strip()
    return tok.encode(response) + [end_token(tok, fmt)]


def padding_token(tok: Tokenizer, fmt: str) -> int:
    """Fills a row after its response. The layout ends a row at its first
    one, so in the chat formats it is not the end-of-turn token, which also
    closes the user turn."""
    if fmt in ("llama3-chat", "chatml"):
        return tok.token_id("<|end_of_text|>" if fmt == "llama3-chat"
                            else "<|endoftext|>")
    return end_token(tok, fmt)


def training_sequences(pairs, tok: Tokenizer, fmt: str,
                       seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Formatted, cut and padded pairs -> (rows (n, seq_len) int32,
    response: (n, seq_len) bool)."""
    out = torch.full((len(pairs), seq_len), padding_token(tok, fmt), dtype=torch.int32)
    response = torch.ones(len(pairs), seq_len, dtype=torch.bool)
    for i, (prompt, answer) in enumerate(pairs):
        asked = prompt_tokens(tok, fmt, prompt)
        ids = (asked + response_tokens(tok, fmt, answer))[:seq_len]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        # the prompt: context, never a target
        response[i, : len(asked)] = False
    return out, response


# ------ plumbing: reading and writing Hugging Face tokenizer files ------

def gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's JSON byte table: a printable byte is its own char, the i-th
    other one chr(256 + i)."""
    # visible ASCII and Latin-1
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + i) for i, b in enumerate(shifted)}}


GPT2_BYTE_TO_CHAR = gpt2_byte_to_char()
GPT2_CHAR_TO_BYTE = {c: b for b, c in GPT2_BYTE_TO_CHAR.items()}


def bytes_to_piece(token: bytes) -> str:
    return "".join(GPT2_BYTE_TO_CHAR[b] for b in token)


def piece_to_bytes(piece: str) -> bytes:
    # KeyError: not a byte-level string
    return bytes(GPT2_CHAR_TO_BYTE[c] for c in piece)


def read_hf_tokenizer_json(spec: dict, file: Path) -> tuple[dict, dict, str, bool]:
    """A parsed tokenizer.json -> (mergeable_ranks, special_tokens, split
    pattern, nfc)."""
    unsupported = f"unsupported tokenizer in {file}"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(f"{unsupported}: only byte-level BPE is supported, "
                         f"got model type {model.get('type')!r}")
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    special_ids = set(specials.values())
    # a trained vocab may list the special tokens too: they stay special only
    try:
        ranks = {piece_to_bytes(piece): i for piece, i in model["vocab"].items()
                 if i not in special_ids}
    except KeyError as err:
        raise ValueError(f"{unsupported}: vocab is not byte-level") from err
    if model.get("unk_token") and sum(len(t) == 1 for t in ranks) < 256:
        raise ValueError(f"{unsupported}: single bytes are missing and map "
                         f"to an unknown token")

    # The split regex: Split + ByteLevel, GPT-2's ByteLevel alone, or
    # ByteLevel after a Digits step.
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    last = steps[-1] if steps and steps[-1].get("type") == "ByteLevel" else {}
    first = steps[0] if len(steps) == 2 else {}
    byte_level_regex = last.get("use_regex", True)
    split_regex = (first.get("type") == "Split"
                   and "Regex" in first.get("pattern", {})
                   and not first.get("invert")
                   and first.get("behavior") == "Isolated")
    pattern = None
    if last and not last.get("add_prefix_space", True):
        if first == {"type": "Digits", "individual_digits": True} and byte_level_regex:
            pattern = DIGITS_THEN_GPT2_PATTERN
        elif split_regex and not byte_level_regex:
            pattern = first["pattern"]["Regex"]
        elif len(steps) == 1 and byte_level_regex:
            pattern = GPT2_PATTERN
    if pattern is None:
        raise ValueError(f"unsupported pre_tokenizer in {file}: "
                         f"{json.dumps(pre)[:200]}")

    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise ValueError(f"unsupported normalizer in {file}: "
                         f"{normalizer.get('type')!r}")
    return ranks, specials, pattern, normalizer is not None


def llama3_special_tokens(first_id: int) -> dict[str, int]:
    """Llama 3.1's 256 special tokens: a few named ones, the rest
    <|reserved_special_token_i|>."""
    named = {0: "begin_of_text", 1: "end_of_text", 4: "finetune_right_pad_id",
             6: "start_header_id", 7: "end_header_id", 8: "eom_id",
             9: "eot_id", 10: "python_tag"}
    reserved = iter(f"reserved_special_token_{n}" for n in range(256))
    return {f"<|{named.get(i) or next(reserved)}|>": first_id + i
            for i in range(256)}


def hf_tokenizer_json(tok: Tokenizer) -> dict:
    """tokenizer.json as read plus new specials, or vocab + merges making
    HF's BPE act as ours."""
    flags = {**dict.fromkeys(["single_word", "lstrip", "rstrip", "normalized"], False),
             "special": True}
    if tok.hf_spec is not None:
        added = tok.hf_spec["added_tokens"]
        known = {t["content"] for t in added}
        new = [{"id": i, "content": t, **flags}
               for t, i in tok.special_tokens.items() if t not in known]
        return {**tok.hf_spec, "added_tokens": added + new}

    vocab = {bytes_to_piece(b): r for b, r in tok.mergeable_ranks.items()}
    merges = []
    for token, rank in sorted(tok.mergeable_ranks.items(), key=lambda item: item[1]):
        # The last merge tiktoken makes to build this token: its merge
        # loop, using lower ranks only.
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pair_ranks = [tok.mergeable_ranks.get(a + b, rank)
                          for a, b in zip(parts, parts[1:])]
            # leftmost on ties
            best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[best] >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append([bytes_to_piece(parts[0]), bytes_to_piece(parts[1])])

    # HF numbers added tokens missing from the vocab len(vocab),
    # len(vocab)+1, ...: keep other ids.
    specials = sorted(tok.special_tokens.items(), key=lambda item: item[1])
    if [i for _, i in specials] != list(range(len(vocab), len(vocab) + len(specials))):
        vocab.update(specials)
    split = {"type": "Split", "pattern": {"Regex": tok.pattern},
             "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False,
                  "trim_offsets": True, "use_regex": False}
    decoder = {**byte_level, "add_prefix_space": True, "use_regex": True}
    return {"version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [{"id": i, "content": text, **flags}
                             for text, i in specials],
            "normalizer": {"type": "NFC"} if tok.nfc else None,
            "pre_tokenizer": {"type": "Sequence",
                              "pretokenizers": [split, byte_level]},
            "post_processor": None,
            "decoder": decoder,
            # ignore_merges: a piece that is itself a token is looked up
            # whole, as tiktoken does
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False,
                      "byte_fallback": False, "ignore_merges": True,
                      "vocab": vocab, "merges": merges}}


# ------ plumbing: SmolLM2's tokenizer from a GGUF file (scripts/get_smollm2.py) ------

# llama.cpp's token type of special tokens
GGUF_CONTROL = 3


def write_gguf_tokenizer(field, out: Path):
    """tokenizer.json + tokenizer_config.json in `out` from the tokenizer fields of a GGUF file
    (llama.cpp's format); `field(name)` reads one field's contents.

    The pre-tokenizer is SmolLM2's own, which llama.cpp records as "smollm": every digit is its
    own piece, then GPT-2's byte-level split. transformers' GGUF converter drops the digit step.
    """
    if (field("tokenizer.ggml.model") != "gpt2"
            or field("tokenizer.ggml.pre") != "smollm"):
        raise ValueError("expected a byte-level BPE tokenizer with the 'smollm' "
                         "pre-tokenizer in the GGUF file")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    merges = field("tokenizer.ggml.merges")
    specials = [(i, t) for i, (t, kind) in enumerate(zip(tokens, types))
                if kind == GGUF_CONTROL]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    flags = dict.fromkeys(["single_word", "lstrip", "rstrip", "normalized"], False)
    digits = {"type": "Digits", "individual_digits": True}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, **flags, "special": True}
                         for i, t in specials],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [digits, byte_level]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ") for m in merges]},
    }
    text = json.dumps(spec, ensure_ascii=False)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    # each role's token: tokenizer_config.json's name -> the GGUF field of its id
    roles = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "clean_up_tokenization_spaces": False,
              "model_max_length": int(field("llama.context_length")),
              **{f"{role}_token": tokens[int(field(f"tokenizer.ggml.{gguf}_token_id"))]
                 for role, gguf in roles.items()},
              "chat_template": field("tokenizer.chat_template")}
    text = json.dumps(config, indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
