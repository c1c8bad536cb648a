"""The toy tasks (tasks/toy.py): answers, checkers, batches and the held-out split.

The checkers are the ruler every figure in train_toy.py's results.json is measured with, so
they get their own tests: a correct answer scores 1, an incoherent mixture of branches scores
0, and a run of a repeated item is flagged as degeneration. Held-out prompts must never be
trained on.
"""
import random
from collections import Counter
from functools import partial

import pytest

from tasks.toy import (COUNT_SHOWN, COUNT_STARTS, NUM_ITEMS, TOY_SEQ_LEN, TOY_TASKS,
                       ZOO_VISITS, ToyExample, check_toy, encode_example, has_run,
                       heldout_examples, is_heldout, toy_answer, toy_batch, toy_example,
                       toy_prompt, toy_tokenizer, zoo_traits)

COUNT_TO_32 = " 19 20 21 22 23 24 25 26 27 28 29 30 31 32"


# --- checkers --------------------------------------------------------------------------

@pytest.mark.parametrize("task", TOY_TASKS)
def test_generated_answers_score_one(task):
    rng = random.Random(0)
    for _ in range(20):
        ex = toy_example(task, rng)
        score = check_toy(task, ex.key, ex.answer)
        scored = (score.accuracy, score.coherence, score.degenerate)
        assert scored == (True, True, False), ex


def test_count_carries_on_from_the_prompt():
    key = (17, 3)
    prompt = toy_prompt("count", key)
    ex = ToyExample("count", key, prompt, "")
    assert ex.prompt == "count 17 18 19"
    items = toy_answer("count", key, random.Random(0))
    assert items[:2] == ["20", "21"]
    # 16 numbers in all
    assert check_toy("count", key, " 20 21 22 23 24 25 26 27 28 29 30 31 32").accuracy


def test_count_checker():
    # "count 17 18"
    check = partial(check_toy, "count", (17, 2))
    assert check(COUNT_TO_32).accuracy
    # the right rule, the wrong length
    short = check(" 19 20 21")
    assert short.coherence
    assert not short.accuracy
    assert not check(COUNT_TO_32, stopped=False).accuracy
    assert not check(COUNT_TO_32 + " 33").accuracy
    wrong_way = check(" 17 16 15 14 13 12 11 10 9 8 7 6")
    assert not wrong_way.coherence
    assert not wrong_way.accuracy
    # repeats the prompt's last number; a wrong step; not a number
    assert not check(" 18 19 20").coherence
    assert not check(" 19 21 23").coherence
    assert not check(" 19 20 cat 22").coherence
    assert not check("").coherence
    # a digit int() cannot read, and one it can (Arabic-Indic 20)
    assert not check(" 19 ² 21").coherence
    assert check(" 19 ٢٠ 21").coherence


def test_branching_checkers_accept_every_branch_and_reject_mixtures():
    count_free = partial(check_toy, "count_free", (17,))
    for answer in (" 18 19 20 21 22 23 24 25 26 27 28 29",
                   " 16 15 14 13 12 11 10 9 8 7 6 5"):
        assert count_free(answer).accuracy
    # each position picks its own branch
    score = count_free(" 18 15 20 13 22 11 24 9 26 7 28 5")
    assert (score.accuracy, score.coherence) == (False, False)

    # "alternate the with red pie fox cup"
    check = partial(check_toy, "alternate", ("red", "pie", "fox", "cup"))
    for answer in (" the red", " red the", " pie the", " fox the", " cup the"):
        assert check(answer * 6).accuracy
    # mixed; "the" missing; not a prompt word; after a leading "the": the first word
    assert not check(" the red the pie" * 3).coherence
    assert not check(" red pie" * 6).coherence
    assert not check(" the dog" * 6).coherence
    assert not check(" the pie" * 6).coherence
    # the right rule, the wrong length
    short = check(" the red" * 5 + " the")
    assert short.coherence and not short.accuracy


def test_alternate_marginals_collapse_while_greedy_stays_coherent():
    """Why naive MTP degenerates on alternate: the most frequent word at EVERY position is
    "the", yet decoding the conditionals greedily ("the" first, then what follows it) gives
    a valid answer."""
    rng = random.Random(0)
    key = ("red", "pie", "fox", "cup")
    answers = [toy_answer("alternate", key, rng) for _ in range(4000)]
    for i in range(NUM_ITEMS):
        counts = Counter(a[i] for a in answers).most_common(2)
        (top, n_top), (_, n_next) = counts
        assert top == "the", (i, counts)
        assert n_top > 1.2 * n_next, (i, counts)

    # a clear favourite at the choice, then no choice left
    favourites = Counter(a[0] for a in answers).most_common(2)
    (top, n_top), (_, n_next) = favourites
    assert top == "the"
    assert n_top > 2 * n_next
    second = Counter(a[1] for a in answers if a[0] == "the")
    assert second == Counter({"red": second["red"]})
    assert check_toy("alternate", key, " the red" * 6).accuracy


def test_zoo_checker():
    # "zoo cat owl fox"
    check = partial(check_toy, "zoo", ("cat", "owl", "fox"))
    assert zoo_traits("cat") == ["red", "pie"]
    assert zoo_traits("owl") == ["black", "bean"]
    answer = " cat red pie owl black bean fox gold corn cat red pie"
    # in any order
    for valid in (answer, " fox gold corn fox gold corn owl black bean cat red pie"):
        assert check(valid).accuracy
    invalid = (
        # another animal's traits
        " cat red pie owl gold corn fox black bean cat red pie",
        # not a prompt animal
        " dog blue jam cat red pie owl black bean cat red pie",
        # colour and food swapped
        " cat pie red owl black bean fox gold corn cat red pie",
        # no animal first
        " red pie cat owl black bean")
    for output in invalid:
        score = check(output)
        assert (score.accuracy, score.coherence) == (False, False), output
    # the right rule, the wrong length
    short = check(" cat red pie owl black")
    assert short.coherence
    assert not short.accuracy
    assert not check(answer, stopped=False).accuracy
    assert not check(answer + " owl black bean").accuracy
    assert check(" cat cat cat owl black bean").degenerate


def test_zoo_chooses_every_third_item_and_the_choice_fixes_the_next_two():
    """Why zoo separates the students under ConfAdapt: at every visit the data branches (the
    favourite animal 70% of the time, so before the choice is made no guess of the animal, or
    of the colour and food after it, is 90% sure), yet given the animal its colour and food
    are certain, and taking the favourite every time, as a greedy model does, gives a valid
    answer."""
    rng = random.Random(0)
    key = ("cat", "owl", "fox")
    answers = [toy_answer("zoo", key, rng) for _ in range(4000)]
    # a mix at every item
    for i in range(NUM_ITEMS):
        counts = Counter(a[i] for a in answers)
        [(_, n_top)] = counts.most_common(1)
        share = n_top / len(answers)
        assert share < 0.75, (i, share)
    # no choice after the animal
    for a in answers:
        for visit in range(0, NUM_ITEMS, 3):
            assert a[visit + 1:visit + 3] == zoo_traits(a[visit])
    # the favourite each time
    greedy = ["cat", "red", "pie"] * ZOO_VISITS
    outputs = Counter(tuple(a) for a in answers)
    [(most_common, _)] = outputs.most_common(1)
    assert most_common == tuple(greedy)
    assert check_toy("zoo", key, " " + " ".join(greedy)).accuracy


def test_degeneration_is_a_run_of_one_item():
    # "the the the"
    key = ("red", "pie", "fox", "cup")
    collapsed = check_toy("alternate", key, " the" * 12)
    assert collapsed.degenerate
    assert not collapsed.coherence
    assert check_toy("count", (5, 2), " 7 8 8 8 9").degenerate
    repeat = partial(check_toy, "repeat", ("red", "cup"))
    assert repeat(" red cup cup cup red").degenerate
    # 2 < DEGENERATE_RUN
    assert not repeat(" red cup cup red").degenerate
    assert has_run(["the", "the", "the"])
    assert not has_run(["a", "b", "a", "b"])


# --- data ------------------------------------------------------------------------------

def test_sequences_are_bos_prompt_answer_eos_and_fit():
    tok = toy_tokenizer()
    rng = random.Random(0)
    for task in TOY_TASKS:
        ex = toy_example(task, rng)
        prompt, answer = encode_example(tok, ex)
        assert prompt[0] == tok.bos_id
        assert answer[-1] == tok.eos_id
        # every item is one token
        assert len(answer) == len(ex.answer.split()) + 1
        text = tok.decode(prompt[1:] + answer[:-1])
        assert text == ex.prompt + ex.answer

    seq_len = TOY_SEQ_LEN
    batch, answer = toy_batch(tok, rng, 64, seq_len=seq_len)
    assert batch.shape == answer.shape == (64, seq_len)
    assert (batch[:, 0] == tok.bos_id).all()
    eos_per_row = (batch == tok.eos_id).sum(1)
    assert (eos_per_row == 1).all()
    # one per row: the <|eos|>
    last_answer = answer & ~answer.roll(-1, 1)
    assert (batch[last_answer] == tok.eos_id).all()
    assert (last_answer.sum(1) == 1).all()
    # prompts hold no <|eos|>
    prompts = ~answer & (batch != tok.pad_id)
    assert (batch[prompts] != tok.eos_id).all()


def test_every_toy_number_is_one_token():
    tok = toy_tokenizer()
    rng = random.Random(0)
    keys = {"count": [(start, shown) for start in COUNT_STARTS
                      for shown in COUNT_SHOWN],
            "count_free": [(start,) for start in COUNT_STARTS]}
    for task, task_keys in keys.items():
        for key in task_keys:
            # both directions
            for _ in range(8):
                items = toy_answer(task, key, rng)
                text = " " + " ".join(items)
                n_tokens = len(tok.encode(text))
                assert n_tokens == len(items), (task, key, items)
            prompt = toy_prompt(task, key)
            assert len(tok.encode(prompt)) == len(prompt.split())


@pytest.mark.parametrize("task", TOY_TASKS)
def test_heldout_prompts_are_never_trained_on(task):
    rng = random.Random(1)
    train_keys = {toy_example(task, rng).key for _ in range(3000)}
    heldout = heldout_examples(task, 48)
    assert heldout
    assert all(is_heldout(task, ex.key) for ex in heldout)
    assert not any(is_heldout(task, key) for key in train_keys)
    assert train_keys.isdisjoint(ex.key for ex in heldout)
    assert len({ex.key for ex in heldout}) == len(heldout)
    # fixed
    again = heldout_examples(task, 48)
    assert [ex.prompt for ex in again] == [ex.prompt for ex in heldout]


@pytest.mark.parametrize("task", ["count", "count_free"])
def test_heldout_counts_only_take_steps_seen_in_training(task):
    """A held-out start is new as a prompt, but every step of its count (a -> a+1) was
    trained on."""
    def steps(ex):
        words = ex.prompt.split()[1:]
        shown = [int(x) for x in words if x.isdigit()]
        nums = shown + [int(x) for x in ex.answer.split()]
        return set(zip(nums, nums[1:]))

    rng = random.Random(2)
    trained = [toy_example(task, rng) for _ in range(5000)]
    seen = set().union(*map(steps, trained))
    for ex in heldout_examples(task, 48):
        assert steps(ex) <= seen, ex
