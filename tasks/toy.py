"""The toy tasks train_toy.py is taught with: five tasks a CPU transformer learns in minutes,
their held-out split, examples and batches, the checkers that score a generated answer, and
the toy vocabulary (every number below 1000 and every toy word one token)."""
import random
import zlib
from dataclasses import dataclass

import torch

from mtp.tokenizer import Tokenizer, whole_token_tokenizer


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
