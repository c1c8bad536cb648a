"""Synthetic word problems (a miniature GSM8K), their training and test rows, batches and
tokenizer, and the domain prompts of `finetune_hf.py data` and `analyze`."""
import json
import random
from dataclasses import dataclass
from pathlib import Path

import regex

from mtp.tokenizer import GPT2_PATTERN, Tokenizer, training_sequences, whole_token_tokenizer


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
PROMPTS = Path(__file__).parent.parent / "prompts"
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
