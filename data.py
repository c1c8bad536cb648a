"""Data for multi-token prediction (MTP): the packed training layout, and
what fills it (toy tasks, byte-level BPE tokenizers in Hugging Face files,
prompt formats, word problems, chat prompts)."""
import base64
import json
import random
import unicodedata
import zlib
from dataclasses import dataclass
from pathlib import Path

# tiktoken's dependency: the same regular expressions as its splitter
import regex
import tiktoken
import torch


# ========================= MTP training layout =========================
# A row of N ground-truth tokens packs M independent MTP problems
# ("regions"). Region r's prefix ends at original index e_r = o + r R
# (R = N // M, offset o in [0, R)), and k-1 <mask> slots follow it.
#
# The index convention, the same in every file: a region's k predictions
# are numbered j = 0 .. k-1, and prediction j guesses the token j + 1
# places after the prefix (original index e_r + 1 + j). Prediction 0 is
# read at the last prefix token: the ordinary next token. Prediction
# j >= 1 is read at mask slot j, which sits at position e_r + j: the place
# of the token that prediction j-1 guesses. For the prefix "a b c" (e_r = 2)
# followed by "d e f", with k = 3:
#
#     prediction 0   at c        (position 2)   guesses d
#     prediction 1   at slot 1   (position 3)   guesses e
#     prediction 2   at slot 2   (position 4)   guesses f
#
# The teacher's input (distill.py) puts the student's guess of prediction
# j-1 into slot j, so prediction j sees the prefix and guesses 0 .. j-1.
#
# The tokens the slots stand for follow as COPIES at their own positions,
# so ground truth keeps its ordinary context. The first EOS, at index
# E >= 1 (Qwen rows start with one), ends a row: region r is supervised
# iff e_r < E, targets after E are EOS, and the rest is padding (no loss,
# unseen, seeing only itself so that each softmax row is defined).
# Without an EOS a target past N - 1 is unsupervised. L = N + M (k - 1).

# token kinds in the packed layout
GT = 0
MASK = 1
COPY = 2
PAD = 3


@dataclass
class MTPBatch:
    """What one MTP training step needs: B rows packed to length L, each
    with M regions of k predictions."""

    # (B, L) long: ground truth, k-1 mask slots after each e_r, padding
    input_ids: torch.Tensor
    # (B, L) long: the original index of ground truth; slot j: e_r + j
    positions: torch.Tensor
    # (B, L, L) bool: True = the query (row) may attend to the key (column)
    attn_mask: torch.Tensor
    # (B, L) long: GT / MASK / COPY / PAD
    kind: torch.Tensor

    # (B, M, k) long: the packed index of prediction j of region r
    pred_index: torch.Tensor
    # (B, M, k) long: the ground-truth token prediction j should produce
    targets: torch.Tensor
    # (B, M, k) bool: the prediction is supervised
    valid: torch.Tensor

    # (B, N) long: the packed index of ground-truth token i (original index i)
    gt_index: torch.Tensor
    # (B, N-1) long: the next ground-truth token (tokens 1 .. N-1)
    ntp_targets: torch.Tensor
    # (B, N-1) bool: the next token is real (not after the EOS)
    ntp_valid: torch.Tensor

    # (M,) long: the original index e_r of each region's last prefix token
    prefix_end: torch.Tensor
    k: int
    offset: int
    region_len: int

    def to(self, device) -> "MTPBatch":
        return MTPBatch(**{f: v.to(device) if torch.is_tensor(v) else v
                           for f, v in vars(self).items()})


def mtp_layout(seqs: torch.Tensor, k: int, offset: int, n_regions: int,
               mask_id: int, eos_id=None, pad_id: int = 0,
               trained: torch.Tensor | None = None) -> MTPBatch:
    """Pack ground-truth rows (B, N) into M = n_regions MTP problems each.

    `eos_id`: an int, a list of ints (any of them ends a row) or None.
    `trained` (B, N) bool: which tokens may be targets (answers, say, not
    prompts; a target after the EOS counts as the EOS).
    Example: N = 12, k = 3, M = 2 (R = 6), offset 2, so e = (2, 8); kinds
    G/M/C = ground truth / mask slot / copy; `r.j` = prediction j of
    region r, above the token it must produce:

        idx       0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
        token     a   b   c   M   M   d   e   f   g   h   i   M   M   j   k   l
        pos       0   1   2   3   4   3   4   5   6   7   8   9  10   9  10  11
        kind      G   G   G   M   M   C   C   G   G   G   G   M   M   C   C   G
        pred            0.0 0.1 0.2                     1.0 1.1 1.2
        target            d   e   f                       j   k   l

    The mask at index 3 sees a b c and itself; the one at index 4 sees
    a b c, index 3 and itself; d (index 5) sees a b c d.
    """
    B, N = seqs.shape
    device = seqs.device
    M = n_regions
    R = N // n_regions
    # mask slots per region
    n_slots = k - 1
    if not 1 <= M <= N:
        raise ValueError(f"need 1 <= n_regions <= seq_len, "
                         f"got n_regions={M}, seq_len={N}")
    if not 0 <= offset < R:
        raise ValueError(f"need 0 <= offset < seq_len // n_regions = {R}, "
                         f"got offset={offset}")

    # 1. Where everything lands, the same in every row: ground-truth token
    # i moves right by n_slots for every prefix end before it.
    ends = offset + R * torch.arange(M, device=device)        # (M,) the e_r
    L = N + M * n_slots
    # (N,) the original index of each ground-truth token
    orig = torch.arange(N, device=device)
    gt_index = orig + n_slots * (orig[:, None] > ends[None, :]).sum(1)   # (N,)
    # prediction 0 at e_r, prediction j >= 1 at slot j right after it
    pred_index = gt_index[ends][:, None] + torch.arange(k, device=device)  # (M, k)
    slot_index = pred_index[:, 1:]                             # (M, n_slots)
    # prediction j guesses token e_r + 1 + j; slot j stands for the token
    # prediction j-1 guesses, at that token's position
    target_idx = ends[:, None] + 1 + torch.arange(k, device=device)   # (M, k)
    stands_for = target_idx[:, :-1]                            # (M, n_slots)

    input_ids = torch.full((B, L), mask_id, dtype=torch.long, device=device)
    input_ids[:, gt_index] = seqs
    # copies keep their original positions
    positions = torch.zeros(L, dtype=torch.long, device=device)
    positions[gt_index] = orig
    positions[slot_index] = stands_for
    kind = torch.full((L,), GT, device=device)                 # (L,) long
    kind[slot_index] = MASK
    kind[gt_index[stands_for[stands_for < N]]] = COPY

    # 2. Attention before padding: a ground-truth query sees the ground
    # truth up to its own original index; a slot of region r sees the
    # ground truth up to e_r and its own block up to itself.
    # (L,) the region of a slot, -1 elsewhere
    slot_region = torch.full((L,), -1, device=device)
    slot_region[slot_index] = torch.arange(M, device=device)[:, None]
    is_slot = slot_region >= 0
    # (L,) per query
    sees_up_to = torch.where(is_slot, ends[slot_region.clamp(min=0)], positions)
    # (L query, L key)
    sees_gt = ~is_slot[None, :] & (positions[None, :] <= sees_up_to[:, None])
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    same_region = slot_region[:, None] == slot_region[None, :]
    own_block = is_slot[:, None] & same_region & causal

    # 3. Targets: the tokens at target_idx. E is the first EOS, or N
    # (index 0 is never a target).
    if eos_id is None:
        is_eos = torch.zeros(B, N, dtype=torch.bool, device=device)
    else:
        eos_ids = torch.as_tensor(eos_id, device=device).reshape(-1)
        is_eos = (seqs[..., None] == eos_ids).any(-1)          # (B, N)
    is_eos[:, 0] = False
    E = torch.where(is_eos, orig, N).min(1).values             # (B,)
    has_eos = E < N
    # (B,) the EOS, or the last token of a row without one
    last = E.clamp(max=N - 1)
    targets = seqs[:, target_idx.clamp(max=N - 1)]             # (B, M, k)
    eos_tok = seqs.gather(1, last[:, None])                    # (B, 1)
    after_eos = (target_idx[None] > E[:, None, None]) & has_eos[:, None, None]
    targets = torch.where(after_eos, eos_tok[:, :, None], targets)
    supervised_region = ends[None, :] < E[:, None]             # (B, M)
    # inside the row, or after its EOS
    in_text = (target_idx[None] < N) | has_eos[:, None, None]  # (B, M, k)
    valid = supervised_region[:, :, None] & in_text
    ntp_valid = orig[None, 1:] <= E[:, None]
    if trained is not None:
        # a target after the EOS is the EOS: `trained` is read there
        target_at = torch.minimum(target_idx[None], last[:, None, None])   # (B, M, k)
        valid = valid & trained.gather(1, target_at.flatten(1)).view_as(valid)
        ntp_valid = ntp_valid & trained[:, 1:]

    # 4. Padding: ground truth after the EOS and the blocks of unsupervised
    # regions. Nobody sees padding; padding sees only itself.
    is_pad = torch.zeros(B, L, dtype=torch.bool, device=device)
    is_pad[:, gt_index] = orig[None, :] > E[:, None]
    is_pad[:, slot_index] = ~supervised_region[:, :, None]
    seen = (sees_gt | own_block)[None]
    attn_mask = seen & ~is_pad[:, None, :] & ~is_pad[:, :, None]   # (B, L, L)
    itself = torch.eye(L, dtype=torch.bool, device=device)
    attn_mask |= itself[None] & is_pad[:, :, None]

    # the same for every row -> (B, ...)
    def rows(x):
        return x[None].expand(B, *x.shape).contiguous()

    return MTPBatch(input_ids=torch.where(is_pad, pad_id, input_ids),
                    positions=rows(positions),
                    attn_mask=attn_mask,
                    kind=torch.where(is_pad, PAD, kind[None]),
                    pred_index=rows(pred_index),
                    targets=targets,
                    valid=valid,
                    gt_index=rows(gt_index),
                    ntp_targets=seqs[:, 1:],
                    ntp_valid=ntp_valid,
                    prefix_end=ends,
                    k=k,
                    offset=offset,
                    region_len=R)


def default_n_regions(seq_len: int, k_max: int) -> int:
    """The paper's M = N / (2 k_max): each window stays clear of the next
    prefix end."""
    return max(1, seq_len // (2 * k_max))


def sample_k_and_offset(k_max: int, region_len: int,
                        generator: torch.Generator | None = None) -> tuple[int, int]:
    """k uniform in [2, k_max] and, INDEPENDENTLY, the offset uniform in
    [0, region_len)."""
    k = int(torch.randint(2, k_max + 1, (1,), generator=generator))
    return k, int(torch.randint(0, region_len, (1,), generator=generator))


def random_mtp_layout(seqs: torch.Tensor, k_max: int, mask_id: int,
                      eos_id=None, pad_id: int = 0, n_regions=None,
                      generator: torch.Generator | None = None,
                      trained: torch.Tensor | None = None) -> MTPBatch:
    """One training step's layout: the paper's M regions, k and offset
    drawn independently."""
    n_regions = n_regions or default_n_regions(seqs.shape[1], k_max)
    region_len = seqs.shape[1] // n_regions
    k, offset = sample_k_and_offset(k_max, region_len, generator)
    return mtp_layout(seqs, k=k, offset=offset, n_regions=n_regions,
                      mask_id=mask_id, eos_id=eos_id, pad_id=pad_id,
                      trained=trained)


# ============================== Toy tasks ==============================
# Five tasks a CPU transformer learns in minutes, one token per item:
# <|bos|> prompt answer <|eos|>. Prompt, then one valid answer:
#   count        count 17 18 19
#                -> 20 21 22 ... 32
#   repeat       repeat cat red pie cat red pie
#                -> cat red pie cat red pie ...
#   count_free   count from 17                          (branching)
#                -> 18 19 20 ...  or  16 15 14 ...
#   alternate    alternate the with cat red pie fox     (branching)
#                -> the cat the cat ...  or  red the red ...
#   zoo          zoo cat owl fox                        (branching)
#                -> cat red pie fox gold corn ...
# Branching tasks show naive MTP's two failures. Trained on ground truth,
# count_free's guess n places ahead mixes a+n and a-n, each position
# picking a branch ("18 15 20 13"); in alternate "the" is likeliest at
# EVERY position, so marginals say "the the the the". A token-by-token
# teacher mixes no branches.
# count_free and alternate choose only at their first one or two tokens;
# zoo chooses every third token (which prompt animal comes next), and the
# choice fixes the two after it (the animal's colour and food, the same in
# every prompt). A mask slot after a choice made inside the same forward
# pass cannot read it from the text: trained on the ground truth it learns
# the mix of all branches and is unsure; distilled, it learns the branch
# its own model takes, and is sure (README, Results).
TOY_TASKS = ("count", "repeat", "count_free", "alternate", "zoo")
BRANCHING_TASKS = ("count_free", "alternate", "zoo")
# items in every answer but count's
NUM_ITEMS = 12
# every toy sequence fits: the longest, repeat's, is 21
TOY_SEQ_LEN = 21
# count: the start numbers (every count stays within 0..164), how many
# numbers the prompt shows, and the numbers in prompt + answer
COUNT_STARTS = range(12, 150)
COUNT_SHOWN = (3, 4, 5)
COUNT_LENGTH = 16
# count_free: either way, equally likely
DIRECTIONS = {"up": 1, "down": -1}
# repeat: the words in the repeated group
REPEAT_GROUP = 3
# alternate: the word every answer alternates with, how many prompt words
# to pick the other one from, and how often the glue comes first
ALTERNATE_GLUE = "the"
ALTERNATE_WORDS = 4
ALTERNATE_GLUE_FIRST = 0.4
# zoo: the prompt animals (visited in any order), the visits (3 items
# each: animal, colour, food) and how often a visit repeats the last one
ZOO_ANIMALS = 3
ZOO_VISITS = 4
ZOO_STAY = 0.7
# "the the the": this many equal items in a row
DEGENERATE_RUN = 3
TOY_PROMPT_WORDS = """count from by repeat then and step times
    alternate with zoo""".split()
TOY_WORDS = TOY_PROMPT_WORDS + """the a is to of in up down sum list add next
    cat dog cow pig hen fox owl bee ant bat rat yak eel ape
    duck frog bird fish goat lion
    red blue green pink gray gold black white tan
    pie jam egg tea rice corn bean fig nut pea ham bun cake soup milk
    box cup pen hat key bag map car bus bed pot jar mug cap
    bell book ring lamp drum kite""".split()
# animals, colours, foods, objects
TOY_CONTENT_WORDS = TOY_WORDS[TOY_WORDS.index("cat"):]
ANIMALS = TOY_WORDS[TOY_WORDS.index("cat"):TOY_WORDS.index("red")]
COLOURS = TOY_WORDS[TOY_WORDS.index("red"):TOY_WORDS.index("pie")]
FOODS = TOY_WORDS[TOY_WORDS.index("pie"):TOY_WORDS.index("box")]


def is_heldout(task: str, key: tuple) -> bool:
    """Held-out: count starts 13, 18, ...; count_free starts 15, 20, ...;
    one word tuple in eight."""
    if task in ("count", "count_free"):
        return key[0] % 5 == {"count": 3, "count_free": 0}[task]
    return zlib.crc32(" ".join(key).encode()) % 8 == 0


def toy_prompt(task: str, key: tuple) -> str:
    if task == "count":
        return "count " + " ".join(str(key[0] + i) for i in range(key[1]))
    if task == "count_free":
        return f"count from {key[0]}"
    if task == "repeat":
        return "repeat " + " ".join(key + key)
    if task == "zoo":
        return "zoo " + " ".join(key)
    return f"alternate {ALTERNATE_GLUE} with " + " ".join(key)


def zoo_traits(animal: str) -> list[str]:
    """The two items after an animal in zoo, the same in every prompt: its
    colour and food."""
    i = ANIMALS.index(animal)
    return [COLOURS[i % len(COLOURS)], FOODS[i % len(FOODS)]]


def zoo_visits(key: tuple, rng: random.Random) -> list[str]:
    """zoo's free choices: ZOO_VISITS prompt animals. Each visit is, with
    probability ZOO_STAY, the animal visited last (the first visit: the
    prompt's first animal; either way the item three places back), else
    one of the other two: a clear favourite, which a greedy model takes
    every time and the data only a ZOO_STAY share of the time."""
    visits = []
    favourite = key[0]
    for _ in range(ZOO_VISITS):
        if rng.random() < ZOO_STAY:
            animal = favourite
        else:
            animal = rng.choice([a for a in key if a != favourite])
        visits.append(animal)
        favourite = animal
    return visits


def toy_answer(task: str, key: tuple, rng: random.Random) -> list[str]:
    """One valid answer, as items; for a branching task the branch is
    drawn with rng."""
    if task == "count":
        # on from the prompt's last number to COUNT_LENGTH numbers
        return [str(key[0] + key[1] - 1 + i)
                for i in range(1, COUNT_LENGTH - key[1] + 1)]
    if task == "count_free":
        step = rng.choice(list(DIRECTIONS.values()))
        return [str(key[0] + i * step) for i in range(1, NUM_ITEMS + 1)]
    if task == "repeat":
        return [key[i % len(key)] for i in range(NUM_ITEMS)]
    if task == "zoo":
        # each visit: the animal, then its colour and food
        return [item for animal in zoo_visits(key, rng)
                for item in [animal, *zoo_traits(animal)]]
    # alternate
    if rng.random() < ALTERNATE_GLUE_FIRST:
        pair = (ALTERNATE_GLUE, key[0])
    else:
        pair = (rng.choice(key), ALTERNATE_GLUE)
    return [pair[i % 2] for i in range(NUM_ITEMS)]


@dataclass(frozen=True)
class ToyExample:
    task: str
    # the prompt's parameters (what the held-out split is about)
    key: tuple
    # e.g. "count 17 18 19"
    prompt: str
    # e.g. " 20 21 22 ..." (items with leading spaces)
    answer: str


def toy_example(task: str, rng: random.Random,
                split: str = "train") -> ToyExample:
    """A random example whose key lies in `split` ("train" or "heldout")."""
    if task not in TOY_TASKS:
        raise ValueError(f"unknown toy task {task!r}; "
                         f"tasks: {', '.join(TOY_TASKS)}")
    # draw prompt parameters until they fall in the split
    while True:
        if task == "count":
            # (start, numbers shown)
            key = rng.choice(COUNT_STARTS), rng.choice(COUNT_SHOWN)
        elif task == "count_free":
            key = (rng.choice(COUNT_STARTS),)
        elif task == "zoo":
            key = tuple(rng.sample(ANIMALS, ZOO_ANIMALS))
        else:
            size = REPEAT_GROUP if task == "repeat" else ALTERNATE_WORDS
            key = tuple(rng.sample(TOY_CONTENT_WORDS, size))
        if is_heldout(task, key) == {"train": False, "heldout": True}[split]:
            break
    answer = "".join(" " + item for item in toy_answer(task, key, rng))
    return ToyExample(task, key, toy_prompt(task, key), answer)


def encode_example(tokenizer, ex: ToyExample) -> tuple[list[int], list[int]]:
    """(prompt ids with <|bos|> in front, answer ids with <|eos|> at the
    end)."""
    return ([tokenizer.bos_id] + tokenizer.encode(ex.prompt),
            tokenizer.encode(ex.answer) + [tokenizer.eos_id])


def toy_batch(tokenizer, rng: random.Random, batch_size: int, tasks=TOY_TASKS,
              seq_len: int | None = None,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences, tasks mixed uniformly, right-padded with <|pad|> to
    N = seq_len (or the longest). Returns (seqs (B, N) long, answer (B, N)
    bool: True on answer tokens and <|eos|>)."""
    pairs = [encode_example(tokenizer, toy_example(rng.choice(tasks), rng, split))
             for _ in range(batch_size)]
    longest = max(len(p) + len(a) for p, a in pairs)
    N = seq_len or longest
    if longest > N:
        raise ValueError(f"a toy sequence of {longest} tokens does not fit "
                         f"seq_len={N}")
    pad = [[tokenizer.pad_id] * (N - len(p) - len(a)) for p, a in pairs]
    seqs = torch.tensor([p + a + z for (p, a), z in zip(pairs, pad)])  # (B, N)
    answer = torch.tensor([[False] * len(p) + [True] * len(a) + [False] * len(z)
                           for (p, a), z in zip(pairs, pad)])
    return seqs, answer


def heldout_examples(task: str, n: int, seed: int = 1234) -> list[ToyExample]:
    """n distinct held-out prompts of one task, the same for every run
    (fixed seed)."""
    rng = random.Random(seed)
    found = {}
    for ex in (toy_example(task, rng, "heldout") for _ in range(100 * n)):
        found.setdefault(ex.key, ex)
        if len(found) == n:
            break
    return list(found.values())


@dataclass
class ToyScore:
    # exactly right (branching: a valid answer of the right length)
    accuracy: bool
    # obeys the task's rule (length aside)
    coherence: bool
    # DEGENERATE_RUN equal items in a row, which no task allows
    degenerate: bool


def has_run(items: list[str], run: int = DEGENERATE_RUN) -> bool:
    """True if some item repeats `run` times in a row ("the the the",
    "20 20 20")."""
    return any(len(set(items[i:i + run])) == 1
               for i in range(len(items) - run + 1))


def follows_rule(task: str, key: tuple, items: list[str]) -> bool:
    """The task's rule, checked on the generated items (at least two;
    numbers when counting)."""
    counting = task in ("count", "count_free")
    if len(items) < 2 or counting and not all(x.isdecimal() for x in items):
        return False
    if counting:
        nums = [int(x) for x in items]
        # the prompt's last number, and the step from it
        if task == "count":
            last = key[0] + key[1] - 1
            step = 1
        else:
            last = key[0]
            step = nums[0] - last
        steps = zip([last] + nums, nums)
        return step in DIRECTIONS.values() and all(b - a == step for a, b in steps)
    if task == "repeat":
        return all(item == key[i % len(key)] for i, item in enumerate(items))
    if task == "zoo":
        # visits of prompt animals, each followed by its colour and food
        visits = items[::3]
        if not all(animal in key for animal in visits):
            return False
        expected = [item for animal in visits for item in [animal, *zoo_traits(animal)]]
        return items == expected[:len(items)]
    # alternate
    pair = (items[0], items[1])
    drawable = (pair == (ALTERNATE_GLUE, key[0])
                or pair[0] in key and pair[1] == ALTERNATE_GLUE)
    return drawable and all(item == pair[i % 2] for i, item in enumerate(items))


def check_toy(task: str, key: tuple, output: str,
              stopped: bool = True) -> ToyScore:
    """Score a generated answer (text without <|eos|>; `stopped`: the model
    did emit <|eos|>)."""
    items = output.split()
    coherent = follows_rule(task, key, items)
    if task in BRANCHING_TASKS:
        accurate = coherent and len(items) == NUM_ITEMS
    else:
        # the one right answer
        accurate = items == toy_answer(task, key, random.Random(0))
    return ToyScore(accuracy=accurate and stopped, coherence=coherent,
                    degenerate=has_run(items))


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

    # max id + 1 (ids may have gaps)
    n_vocab = property(lambda self: self._enc.n_vocab)
    # the special tokens' ids by role; None: no such role
    bos_id = property(lambda self: self.special_tokens.get(self.bos_token))
    eos_id = property(lambda self: self.special_tokens.get(self.eos_token))
    pad_id = property(lambda self: self.special_tokens.get(self.pad_token))
    mask_id = property(lambda self: self.special_tokens.get("<mask>"))

    def encode(self, text: str) -> list[int]:
        """Ordinary text -> ids: no BOS added, special-token text is NOT
        parsed."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        raw = text.encode()
        if len(raw.translate(None, self.missing_bytes)) == len(raw):
            return self._enc.encode_ordinary(text)
        # rare: split, drop the bytes the vocab lacks from each piece, merge
        # what is left
        pieces = regex.findall(self.pattern, text)
        kept = [p.encode().translate(None, self.missing_bytes) for p in pieces]
        return [i for piece in kept if piece
                for i in self._enc._encode_single_piece(piece)]

    def decode(self, ids) -> str:
        """Special ids decode to their text; bytes that are not valid UTF-8
        become U+FFFD."""
        raw = self._enc.decode_bytes([int(i) for i in ids])
        return raw.decode("utf-8", errors="replace")

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
            spec = json.loads(json_file.read_text(encoding="utf-8"))
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
        tok_config, *configs = [json.loads(f.read_text("utf-8")) if f.is_file() else {}
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


def toy_whole_tokens() -> list[str]:
    """Every string the toy vocabulary holds as ONE token, besides the 256
    single bytes."""
    # every number below 1000, bare and after a space
    numbers = [f"{space}{n}" for space in ("", " ") for n in range(1000)]
    words = [f" {w}" for w in TOY_WORDS] + TOY_PROMPT_WORDS
    return numbers + words + [" :", " |", " ."]


def toy_tokenizer() -> Tokenizer:
    """The toy tasks' vocabulary: numbers below 1000 and the toy words as
    whole tokens (~2.5k)."""
    return whole_token_tokenizer(toy_whole_tokens())


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
FORMATS = ("llama3-chat", "chatml", "qwen", "plain")
# the system prompt when none is given
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


# ============================ Word problems ============================
# A miniature GSM8K in MetaMathQA / GSM8K rows: one phrasing per template,
# so only sums are hard.
WP_NAMES = ["Tom", "Ann", "Ben", "Sue", "Max", "Amy",
            "Sam", "Eva", "Leo", "Mia", "Joe", "Kim"]
WP_ITEMS = ["apples", "pens", "books", "cards", "eggs",
            "cups", "toys", "coins", "shells", "stamps"]
WP_TEMPLATES = ("gets_more", "gives_away", "boxes", "buys_then_gives",
                "money_left")


@dataclass
class WordProblem:
    question: str
    # the chain of thought, with GSM8K's calculator notes <<a+b=c>>
    solution: str
    answer: int


def calc(a: int, op: str, b: int) -> tuple[int, str]:
    """The result of `a op b`, and the step as GSM8K writes it:
    "a op b = <<a op b=c>>c"."""
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    return c, f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}"


def word_problem(rng: random.Random) -> WordProblem:
    """One problem from a random template (these draws, in this order, fix
    every data set)."""
    template = rng.choice(WP_TEMPLATES)
    # a second person?
    if template in ("boxes", "money_left"):
        name = rng.choice(WP_NAMES)
        other = None
    else:
        name, other = rng.sample(WP_NAMES, 2)
    item = rng.choice(WP_ITEMS)

    if template == "gets_more":
        a = rng.randint(2, 30)
        b = rng.randint(2, 20)
        answer, step = calc(a, "+", b)
        question = (f"{name} has {a} {item}. {other} gives {name} {b} more {item}. "
                    f"How many {item} does {name} have now?")
        solution = (f"{name} starts with {a} {item} and gets {b} more, "
                    f"so {name} has {step} {item}.")
    elif template == "gives_away":
        a = rng.randint(10, 40)
        b = rng.randint(1, a - 1)
        answer, step = calc(a, "-", b)
        question = (f"{name} has {a} {item}. {name} gives {b} {item} to {other}. "
                    f"How many {item} does {name} have left?")
        solution = (f"{name} starts with {a} {item} and gives away {b}, "
                    f"so {name} has {step} {item} left.")
    elif template == "boxes":
        a = rng.randint(2, 9)
        b = rng.randint(2, 9)
        answer, step = calc(a, "*", b)
        question = (f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. "
                    f"How many {item} does {name} buy?")
        solution = (f"Each of the {a} boxes holds {b} {item}, "
                    f"so {name} buys {step} {item}.")
    elif template == "buys_then_gives":
        a = rng.randint(2, 25)
        b = rng.randint(2, 15)
        total, step1 = calc(a, "+", b)
        c = rng.randint(1, total - 1)
        answer, step2 = calc(total, "-", c)
        question = (f"{name} has {a} {item}. {name} buys {b} more {item} "
                    f"and then gives {c} {item} to {other}. "
                    f"How many {item} does {name} have now?")
        solution = (f"After buying {b} more, {name} has {step1} {item}. "
                    f"After giving {c} to {other}, {name} has {step2} {item}.")
    else:
        # money_left
        n = rng.randint(2, 6)
        price = rng.randint(2, 6)
        cost, step1 = calc(n, "*", price)
        money = rng.randint(cost + 1, cost + 25)
        answer, step2 = calc(money, "-", cost)
        question = (f"{name} has ${money}. {name} buys {n} {item} for ${price} each. "
                    f"How much money does {name} have left?")
        solution = (f"The {item} cost {step1} dollars. "
                    f"{name} has {step2} dollars left.")
    return WordProblem(question, solution, answer)


def metamath_row(problem: WordProblem) -> dict:
    # MetaMathQA has no calculator notes
    solution = regex.sub(r"<<[^>]*>>", "", problem.solution)
    return {"query": problem.question,
            "response": f"{solution} The answer is: {problem.answer}",
            "type": "GSM_Synthetic",
            "original_question": problem.question}


def gsm8k_row(problem: WordProblem) -> dict:
    return {"question": problem.question,
            "answer": f"{problem.solution}\n#### {problem.answer}"}


def word_problem_split(n_train: int, n_test: int,
                       seed: int = 0) -> tuple[list, list]:
    """Disjoint training and test problems (lists of WordProblem; no test
    question is in training)."""
    rng = random.Random(seed)
    problems = {}
    while len(problems) < n_train + n_test:
        p = word_problem(rng)
        problems.setdefault(p.question, p)
    problems = list(problems.values())
    return problems[:n_train], problems[n_train:]


def write_word_problems(folder, n_train=20000, n_test=500,
                        seed=0) -> tuple[Path, Path]:
    """train.json (MetaMathQA: one JSON array, as distributed) and
    test.jsonl (GSM8K: JSON lines)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, test = word_problem_split(n_train, n_test, seed)
    train_file = folder / "train.json"
    test_file = folder / "test.jsonl"
    train_file.write_text(json.dumps([metamath_row(p) for p in train], indent=1) + "\n",
                          encoding="utf-8")
    test_file.write_text("".join(json.dumps(gsm8k_row(p)) + "\n" for p in test),
                         encoding="utf-8")
    return train_file, test_file


def word_problem_batch(tokenizer, pairs, rng: random.Random, batch_size: int,
                       seq_len: int):
    """Random "plain" rows (B, seq_len) and which tokens are trained: after
    <bos>, to the first <eos>."""
    rows = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
    seqs = training_sequences(rows, tokenizer, "plain", seq_len)[0].long()
    is_eos = (seqs == tokenizer.eos_id).int()
    # up to the first <eos>; <bos> is given
    supervised = is_eos.cumsum(1) - is_eos == 0                # (B, seq_len)
    supervised[:, 0] = False
    return seqs, supervised


def word_problem_tokenizer() -> Tokenizer:
    """Like `toy_tokenizer`: each piece the templates make and each number
    < 1000 is one token."""
    sample = word_problem_split(3000, 0, seed=12345)[0]
    text = "\n\n".join(f"{p.question}\n\n{metamath_row(p)['response']}"
                       for p in sample)
    words = WP_NAMES + WP_ITEMS + [f"{n}" for n in range(1000)]
    pieces = set(regex.findall(GPT2_PATTERN, text))
    return whole_token_tokenizer(pieces | set(words) | {f" {w}" for w in words})


# ============================ Domain prompts ===========================
# Chat prompts for `finetune_hf.py data` and `analyze`: word problems, or
# a domain's templates filled with its subjects, from prompts/domains.json
# ({domain: {templates, subjects, train_subjects}}): a quarter of
# `subjects` is held out; `train_subjects` only ever train.
# the JSON prompt data (finetune_hf reads it too)
PROMPTS = Path(__file__).parent / "prompts"
DOMAIN_TEMPLATES = json.loads((PROMPTS / "domains.json").read_text("utf-8"))
DOMAINS = ("word_problems", *DOMAIN_TEMPLATES)


def domain_prompts(domain: str, n: int, split: str = "train",
                   seed: int = 0) -> list[str]:
    """Up to n prompts of one domain from its train or test part (a quarter
    of `subjects`)."""
    if domain == "word_problems":
        # the split write_word_problems makes (its test.jsonl)
        train, test = word_problem_split(20000, 500, seed)
        return [p.question for p in (train if split == "train" else test)][:n]
    if domain not in DOMAIN_TEMPLATES:
        raise ValueError(f"unknown domain {domain!r}; "
                         f"choose from {', '.join(DOMAINS)}")
    spec = DOMAIN_TEMPLATES[domain]

    def filled(subjects: list[str], salt: str = "") -> list[str]:
        # every template x subject, in a seeded order
        prompts = [t.format(n=n_items, x=x)
                   for t in spec["templates"] for x in subjects
                   for n_items in (3, 5, 7, 10) if "{n}" in t or n_items == 3]
        random.Random(f"{domain}/{split}/{seed}{salt}").shuffle(prompts)
        return prompts

    prompts = filled([x for i, x in enumerate(spec["subjects"])
                      if (i % 4 == 3) == (split == "test")])
    # training-only subjects go last, so the first n prompts never change
    if split == "train":
        prompts += filled(spec.get("train_subjects", []), "/more")
    return prompts[:n]


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
