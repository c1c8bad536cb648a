"""The synthetic word problems and domain prompts (tasks/word_problems.py): right arithmetic in
both row formats, disjoint training and test splits, a tokenizer with one token per word or
symbol, and domain prompts whose test part never shares a subject with training.
"""
import random
import re

from tasks.gsm8k import score
from tasks.word_problems import (DOMAIN_TEMPLATES, domain_prompts, gsm8k_row, metamath_row,
                                 word_problem, word_problem_split, word_problem_tokenizer)


def test_word_problems_formats_and_split():
    """Generated word problems: right arithmetic in both row formats, disjoint splits,
    one token per word or symbol."""
    rng = random.Random(3)
    for _ in range(50):
        p = word_problem(rng)
        row = metamath_row(p)
        gsm = gsm8k_row(p)
        assert row["response"].endswith(f"The answer is: {p.answer}")
        # The gold answer is parsed from '#### N'.
        assert score(row["response"], gsm["answer"])["flexible_ok"]
        for a, op, b, c in re.findall(r"<<(\d+)([-+*])(\d+)=(-?\d+)>>", gsm["answer"]):
            result = {"+": int(a) + int(b),
                      "-": int(a) - int(b),
                      "*": int(a) * int(b)}
            assert result[op] == int(c)

    train, test = word_problem_split(300, 50, seed=0)
    assert not {p.question for p in train} & {p.question for p in test}

    # One token per word or symbol.
    tok = word_problem_tokenizer()
    row = metamath_row(train[0])
    text = row["query"] + " " + row["response"]
    symbols = sum(text.count(s) for s in ".?,:$")
    assert len(tok.encode(text)) == len(text.split()) + symbols


def test_domain_prompts_hold_a_quarter_of_the_subjects_out():
    """Test prompts use held-out subjects (every fourth), never a training-only one."""
    for domain, spec in DOMAIN_TEMPLATES.items():
        train = domain_prompts(domain, 10**6)
        test = domain_prompts(domain, 10**6, "test")
        assert test
        assert not set(train) & set(test)
        assert len(set(train)) == len(train)
        held_out = spec["subjects"][3::4]
        assert all(any(x in p for x in held_out) for p in test)
        # Training-only subjects: never in a test prompt.
        for x in spec.get("train_subjects", []):
            assert any(x in p for p in train)
            assert not any(x in p for p in test)
        # A fixed order: the first n are a prefix.
        assert domain_prompts(domain, 5) == train[:5]
