"""The toy tasks (data.py) and the end-to-end toy script (train_toy.py).

The checkers are the ruler every figure in results.json is measured with, so they get their
own tests: a correct answer scores 1, an incoherent mixture of branches scores 0, and a run
of a repeated item is flagged as degeneration. Held-out prompts must never be trained on.
The script itself runs once in --quick mode (tiny model, few steps) into a temporary folder.
"""
import json
import os
import random
import re
from collections import Counter
from dataclasses import asdict, replace
from functools import partial

import pytest
import torch

import data
import train_toy
from mtp.hf import from_pretrained, write_json

ROW_KEYS = {"model", "decode", "k", "tau", "task", "accuracy", "coherence", "degeneration",
            "effective_k", "tokens_per_s", "forward_passes"}
COUNT_TO_32 = " 19 20 21 22 23 24 25 26 27 28 29 30 31 32"


# --- checkers --------------------------------------------------------------------------

@pytest.mark.parametrize("task", data.TOY_TASKS)
def test_generated_answers_score_one(task):
    rng = random.Random(0)
    for _ in range(20):
        ex = data.toy_example(task, rng)
        score = data.check_toy(task, ex.key, ex.answer)
        scored = (score.accuracy, score.coherence, score.degenerate)
        assert scored == (True, True, False), ex


def test_count_carries_on_from_the_prompt():
    key = (17, 3)
    prompt = data.toy_prompt("count", key)
    ex = data.ToyExample("count", key, prompt, "")
    assert ex.prompt == "count 17 18 19"
    items = data.toy_answer("count", key, random.Random(0))
    assert items[:2] == ["20", "21"]
    # 16 numbers in all
    assert data.check_toy("count", key, " 20 21 22 23 24 25 26 27 28 29 30 31 32").accuracy


def test_count_checker():
    # "count 17 18"
    check = partial(data.check_toy, "count", (17, 2))
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
    count_free = partial(data.check_toy, "count_free", (17,))
    for answer in (" 18 19 20 21 22 23 24 25 26 27 28 29",
                   " 16 15 14 13 12 11 10 9 8 7 6 5"):
        assert count_free(answer).accuracy
    # each position picks its own branch
    score = count_free(" 18 15 20 13 22 11 24 9 26 7 28 5")
    assert (score.accuracy, score.coherence) == (False, False)

    # "alternate the with red pie fox cup"
    check = partial(data.check_toy, "alternate", ("red", "pie", "fox", "cup"))
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
    answers = [data.toy_answer("alternate", key, rng) for _ in range(4000)]
    for i in range(data.NUM_ITEMS):
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
    assert data.check_toy("alternate", key, " the red" * 6).accuracy


def test_zoo_checker():
    # "zoo cat owl fox"
    check = partial(data.check_toy, "zoo", ("cat", "owl", "fox"))
    assert data.zoo_traits("cat") == ["red", "pie"]
    assert data.zoo_traits("owl") == ["black", "bean"]
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
    answers = [data.toy_answer("zoo", key, rng) for _ in range(4000)]
    # a mix at every item
    for i in range(data.NUM_ITEMS):
        counts = Counter(a[i] for a in answers)
        [(_, n_top)] = counts.most_common(1)
        share = n_top / len(answers)
        assert share < 0.75, (i, share)
    # no choice after the animal
    for a in answers:
        for visit in range(0, data.NUM_ITEMS, 3):
            assert a[visit + 1:visit + 3] == data.zoo_traits(a[visit])
    # the favourite each time
    greedy = ["cat", "red", "pie"] * data.ZOO_VISITS
    outputs = Counter(tuple(a) for a in answers)
    [(most_common, _)] = outputs.most_common(1)
    assert most_common == tuple(greedy)
    assert data.check_toy("zoo", key, " " + " ".join(greedy)).accuracy


def test_degeneration_is_a_run_of_one_item():
    # "the the the"
    key = ("red", "pie", "fox", "cup")
    collapsed = data.check_toy("alternate", key, " the" * 12)
    assert collapsed.degenerate
    assert not collapsed.coherence
    assert data.check_toy("count", (5, 2), " 7 8 8 8 9").degenerate
    repeat = partial(data.check_toy, "repeat", ("red", "cup"))
    assert repeat(" red cup cup cup red").degenerate
    # 2 < DEGENERATE_RUN
    assert not repeat(" red cup cup red").degenerate
    assert data.has_run(["the", "the", "the"])
    assert not data.has_run(["a", "b", "a", "b"])


# --- data ------------------------------------------------------------------------------

def test_sequences_are_bos_prompt_answer_eos_and_fit():
    tok = data.toy_tokenizer()
    rng = random.Random(0)
    for task in data.TOY_TASKS:
        ex = data.toy_example(task, rng)
        prompt, answer = data.encode_example(tok, ex)
        assert prompt[0] == tok.bos_id
        assert answer[-1] == tok.eos_id
        # every item is one token
        assert len(answer) == len(ex.answer.split()) + 1
        text = tok.decode(prompt[1:] + answer[:-1])
        assert text == ex.prompt + ex.answer

    seq_len = train_toy.RunConfig.seq_len
    batch, answer = data.toy_batch(tok, rng, 64, seq_len=seq_len)
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
    tok = data.toy_tokenizer()
    rng = random.Random(0)
    keys = {"count": [(start, shown) for start in data.COUNT_STARTS
                      for shown in data.COUNT_SHOWN],
            "count_free": [(start,) for start in data.COUNT_STARTS]}
    for task, task_keys in keys.items():
        for key in task_keys:
            # both directions
            for _ in range(8):
                items = data.toy_answer(task, key, rng)
                text = " " + " ".join(items)
                n_tokens = len(tok.encode(text))
                assert n_tokens == len(items), (task, key, items)
            prompt = data.toy_prompt(task, key)
            assert len(tok.encode(prompt)) == len(prompt.split())


@pytest.mark.parametrize("task", data.TOY_TASKS)
def test_heldout_prompts_are_never_trained_on(task):
    rng = random.Random(1)
    train_keys = {data.toy_example(task, rng).key for _ in range(3000)}
    heldout = data.heldout_examples(task, 48)
    assert heldout
    assert all(data.is_heldout(task, ex.key) for ex in heldout)
    assert not any(data.is_heldout(task, key) for key in train_keys)
    assert train_keys.isdisjoint(ex.key for ex in heldout)
    assert len({ex.key for ex in heldout}) == len(heldout)
    # fixed
    again = data.heldout_examples(task, 48)
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
    trained = [data.toy_example(task, rng) for _ in range(5000)]
    seen = set().union(*map(steps, trained))
    for ex in data.heldout_examples(task, 48):
        assert steps(ex) <= seen, ex


# --- the script ------------------------------------------------------------------------

def test_a_run_folder_resumes_its_phases_and_refuses_other_settings(tmp_path):
    """The folder keeps its settings (run_config.json, written as JSON: tuples become lists)
    and each finished phase; the same settings load them, other settings are refused with
    every setting that differs named, whatever it is: the model, a schedule, the tasks."""
    out = str(tmp_path)
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    model = train_toy.build_teacher(cfg, data.toy_tokenizer(), "cpu")
    write_json(tmp_path / "run_config.json", asdict(cfg))
    phase = train_toy.Phase(model, log=[{"loss": 1.0}], seconds=2.0)
    train_toy.save_phase(out, "teacher", phase)

    done = train_toy.check_run_folder(out, cfg)
    assert list(done) == ["teacher"]
    assert done["teacher"].log == [{"loss": 1.0}]
    loaded = done["teacher"].model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded[name])

    other = {"dim": 32, "warmup_steps": 2, "weight_decay": 0.2, "n_eval": 3,
             "tasks": ("count", "zoo")}
    for name, value in other.items():
        with pytest.raises(train_toy.CliError, match=f"{name} .* -> "):
            train_toy.check_run_folder(out, replace(cfg, **{name: value}))
    with pytest.raises(train_toy.CliError, match=r"dim 64 -> 32, ffn_dim 192 -> 384\)"):
        train_toy.check_run_folder(out, replace(cfg, dim=32, ffn_dim=384))
    # checkpoints without their settings: an older version's run, never loaded unchecked
    os.remove(tmp_path / "run_config.json")
    with pytest.raises(train_toy.CliError, match="no run_config.json"):
        train_toy.check_run_folder(out, cfg)


def test_both_students_train_on_the_same_batches_and_layouts(monkeypatch):
    """naive vs distill is a fair comparison: step by step the same sequences, k and
    offsets. Only the distilled student needs a frozen copy of the teacher."""
    cfg = train_toy.RunConfig(**{**train_toy.QUICK, "mtp_steps": 3})
    tok = data.toy_tokenizer()
    teacher = train_toy.build_teacher(cfg, tok, "cpu")
    layouts = []
    copies = []
    real = data.random_mtp_layout
    real_copy = train_toy.frozen_teacher

    def recorded(*args, **kwargs):
        layouts.append(real(*args, **kwargs))
        return layouts[-1]

    monkeypatch.setattr(data, "random_mtp_layout", recorded)
    monkeypatch.setattr(train_toy, "frozen_teacher",
                        lambda model: copies.append(model) or real_copy(model))
    batches = partial(data.toy_batch, tok, tasks=cfg.tasks, seq_len=cfg.seq_len)
    for name, mode in train_toy.STUDENT_MODE.items():
        student = train_toy.student_from(teacher, "cpu")
        train_toy.train_phase(name, student, cfg, batches, "cpu", mode=mode,
                              tokenizer=train_toy.student_tokenizer())
    assert len(copies) == 1

    steps = cfg.mtp_steps
    assert len(layouts) == 2 * steps
    for a, b in zip(layouts[:steps], layouts[steps:]):
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.valid, b.valid)
    # k really is drawn per step
    assert len({layout.input_ids.shape for layout in layouts}) > 1


def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "run"
    hf = tmp_path / "hf"
    results = train_toy.main(["--quick", "--out", str(out)])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(results["rows"]))
    rows = on_disk["rows"]
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["model"] in train_toy.MODELS
        assert row["decode"] in ("static", "confadapt", "lossless")
        assert row["task"] in data.TOY_TASKS
        for metric in ("accuracy", "coherence", "degeneration"):
            assert 0.0 <= row[metric] <= 1.0
        assert 1.0 <= row["effective_k"] <= max(row["k"], 1)
        assert (row["tau"] is None) == (row["decode"] != "confadapt")
    decodes = {(r["model"], r["decode"]) for r in rows}
    students = {(m, d) for m in ("naive", "distill")
                for d in ("static", "confadapt", "lossless")}
    assert decodes == {("ntp", "static")} | students
    assert {"device", "seconds", "config"} <= set(on_disk)
    phases = {"teacher", "naive", "distill", "evaluation", "total"}
    assert phases <= set(on_disk["seconds"])

    # provenance: the commit (None outside git), the CPU, the compute dtype, torch, threads
    commit = on_disk["commit"]
    assert commit is None or re.fullmatch("[0-9a-f]{40}", commit)
    assert on_disk["cpu"]
    assert on_disk["dtype"] == "float32"
    assert on_disk["torch"] == torch.__version__
    assert on_disk["threads"] == torch.get_num_threads()
    for png in ("pareto.png", "training_curves.png", "chunks.png"):
        assert (out / png).stat().st_size > 1000, png
    # the PNG header's width: a column per branching task
    header = (out / "pareto.png").read_bytes()
    width = int.from_bytes(header[16:20], "big")
    assert width == 4 * len(data.BRANCHING_TASKS) * 110

    # the summary quotes the rows exactly
    assert set(on_disk["summary"]) == set(data.TOY_TASKS)
    distill = {(r["decode"], r["tau"], r["task"]): r["accuracy"]
               for r in rows if r["model"] == "distill"}
    quoted = on_disk["summary"]["count"]["distill tau=0.9: accuracy"]
    assert quoted == distill["confadapt", 0.9, "count"]

    # --export-hf only exports the finished run: the teacher and both students, named.
    def mtimes():
        return {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    before = mtimes()
    argv = ["--quick", "--out", str(out), "--export-hf", str(hf)]
    exported = train_toy.main(argv)
    assert exported["models"] == ["ntp", "naive", "distill"]
    assert mtimes() == before
    teacher = from_pretrained(hf / "teacher")
    assert teacher.config.mask_token_id is None
    assert (hf / "teacher" / "tokenizer.json").exists()
    for name in ("naive", "distill"):
        student = from_pretrained(hf / name)
        assert student.config.mask_token_id == teacher.config.vocab_size
        assert (hf / name / "tokenizer.json").exists()
    tokens = torch.tensor([[1, 2, 3]])
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    checkpoint = train_toy.check_run_folder(str(out), cfg)["teacher"]
    assert torch.allclose(teacher(tokens), checkpoint.model(tokens), atol=1e-5)
