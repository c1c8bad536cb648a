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
from model import Transformer, write_json

ROW_KEYS = {"model", "decode", "k", "tau", "task", "accuracy", "coherence", "degeneration", "effective_k",
            "tokens_per_s", "forward_passes"}


# --- checkers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", data.TOY_TASKS)
def test_generated_answers_score_one(task):
    rng = random.Random(0)
    for _ in range(20):
        ex = data.toy_example(task, rng)
        score = data.check_toy(task, ex.key, ex.answer)
        assert (score.accuracy, score.coherence, score.degenerate) == (True, True, False), ex


def test_count_carries_on_from_the_prompt():
    ex = data.ToyExample("count", (17, 3), data.toy_prompt("count", (17, 3)), "")
    assert ex.prompt == "count 17 18 19"
    assert data.toy_answer("count", (17, 3), random.Random(0))[:2] == ["20", "21"]
    assert data.check_toy("count", (17, 3), " 20 21 22 23 24 25 26 27 28 29 30 31 32").accuracy   # 16 numbers


def test_count_checker():
    key = (17, 2)                                                     # "count 17 18"
    assert data.check_toy("count", key, " 19 20 21 22 23 24 25 26 27 28 29 30 31 32").accuracy
    short = data.check_toy("count", key, " 19 20 21")
    assert short.coherence and not short.accuracy                     # right rule, wrong length
    assert not data.check_toy("count", key, " 19 20 21 22 23 24 25 26 27 28 29 30 31 32", stopped=False).accuracy
    assert not data.check_toy("count", key, " 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33").accuracy
    wrong_way = data.check_toy("count", key, " 17 16 15 14 13 12 11 10 9 8 7 6")
    assert not wrong_way.coherence and not wrong_way.accuracy
    assert not data.check_toy("count", key, " 18 19 20").coherence    # repeats the prompt's last number
    assert not data.check_toy("count", key, " 19 21 23").coherence    # wrong step
    assert not data.check_toy("count", key, " 19 20 cat 22").coherence
    assert not data.check_toy("count", key, "").coherence
    assert not data.check_toy("count", key, " 19 ² 21").coherence     # a digit int() cannot read
    assert data.check_toy("count", key, " 19 ٢٠ 21").coherence        # one it can (Arabic-Indic 20)


def test_branching_checkers_accept_every_branch_and_reject_mixtures():
    for answer in (" 18 19 20 21 22 23 24 25 26 27 28 29", " 16 15 14 13 12 11 10 9 8 7 6 5"):
        assert data.check_toy("count_free", (17,), answer).accuracy
    mixture = " 18 15 20 13 22 11 24 9 26 7 28 5"                    # each position picks its own branch
    score = data.check_toy("count_free", (17,), mixture)
    assert (score.accuracy, score.coherence) == (False, False)

    key = ("red", "pie", "fox", "cup")                                # "alternate the with red pie fox cup"
    for answer in (" the red" * 6, " red the" * 6, " pie the" * 6, " fox the" * 6, " cup the" * 6):
        assert data.check_toy("alternate", key, answer).accuracy
    assert not data.check_toy("alternate", key, " the red the pie the red the pie the red the pie").coherence  # mixed
    assert not data.check_toy("alternate", key, " red pie" * 6).coherence                  # "the" missing
    assert not data.check_toy("alternate", key, " the dog" * 6).coherence                  # not a prompt word
    assert not data.check_toy("alternate", key, " the pie" * 6).coherence      # after a leading "the": the first word
    short = data.check_toy("alternate", key, " the red" * 5 + " the")
    assert short.coherence and not short.accuracy                                   # right rule, wrong length


def test_alternate_marginals_collapse_while_greedy_stays_coherent():
    """Why naive MTP degenerates on alternate: the most frequent word at EVERY position is "the",
    yet decoding the conditionals greedily ("the" first, then what follows it) gives a valid
    answer."""
    rng = random.Random(0)
    key = ("red", "pie", "fox", "cup")
    answers = [data.toy_answer("alternate", key, rng) for _ in range(4000)]
    for i in range(data.NUM_ITEMS):
        counts = Counter(a[i] for a in answers).most_common(2)
        assert counts[0][0] == "the" and counts[0][1] > 1.2 * counts[1][1], (i, counts)
    first = Counter(a[0] for a in answers).most_common(2)
    second = Counter(a[1] for a in answers if a[0] == "the")
    assert first[0][0] == "the" and first[0][1] > 2 * first[1][1]       # a clear favourite at the choice
    assert second == Counter({"red": second["red"]})                    # then no choice left
    assert data.check_toy("alternate", key, " the red" * 6).accuracy


def test_zoo_checker():
    key = ("cat", "owl", "fox")                                       # "zoo cat owl fox"
    assert data.zoo_traits("cat") == ["red", "pie"] and data.zoo_traits("owl") == ["black", "bean"]
    answer = " cat red pie owl black bean fox gold corn cat red pie"
    for valid in (answer, " fox gold corn fox gold corn owl black bean cat red pie"):   # any order
        assert data.check_toy("zoo", key, valid).accuracy
    invalid = (" cat red pie owl gold corn fox black bean cat red pie",   # another animal's traits
               " dog blue jam cat red pie owl black bean cat red pie",    # not a prompt animal
               " cat pie red owl black bean fox gold corn cat red pie",   # colour and food swapped
               " red pie cat owl black bean")                             # no animal first
    for output in invalid:
        score = data.check_toy("zoo", key, output)
        assert (score.accuracy, score.coherence) == (False, False), output
    short = data.check_toy("zoo", key, " cat red pie owl black")
    assert short.coherence and not short.accuracy                     # right rule, wrong length
    assert not data.check_toy("zoo", key, answer, stopped=False).accuracy
    assert not data.check_toy("zoo", key, answer + " owl black bean").accuracy
    assert data.check_toy("zoo", key, " cat cat cat owl black bean").degenerate


def test_zoo_chooses_every_third_item_and_the_choice_fixes_the_next_two():
    """Why zoo separates the students under ConfAdapt: at every visit the data branches (the
    favourite animal 70% of the time, so before the choice is made no guess of the animal, or of
    the colour and food after it, is 90% sure), yet given the animal its colour and food are
    certain, and taking the favourite every time, as a greedy model does, gives a valid answer."""
    rng = random.Random(0)
    key = ("cat", "owl", "fox")
    answers = [data.toy_answer("zoo", key, rng) for _ in range(4000)]
    for i in range(data.NUM_ITEMS):
        share = Counter(a[i] for a in answers).most_common(1)[0][1] / len(answers)
        assert share < 0.75, (i, share)                               # a mix at every item
    for a in answers:
        for visit in range(0, data.NUM_ITEMS, 3):
            # no choice after the animal
            assert a[visit + 1:visit + 3] == data.zoo_traits(a[visit])
    greedy = ["cat", "red", "pie"] * data.ZOO_VISITS                 # the favourite each time
    assert Counter(tuple(a) for a in answers).most_common(1)[0][0] == tuple(greedy)
    assert data.check_toy("zoo", key, " " + " ".join(greedy)).accuracy


def test_degeneration_is_a_run_of_one_item():
    collapsed = data.check_toy("alternate", ("red", "pie", "fox", "cup"), " the" * 12)   # "the the the"
    assert collapsed.degenerate and not collapsed.coherence
    assert data.check_toy("count", (5, 2), " 7 8 8 8 9").degenerate
    assert data.check_toy("repeat", ("red", "cup"), " red cup cup cup red").degenerate
    assert not data.check_toy("repeat", ("red", "cup"), " red cup cup red").degenerate   # 2 < DEGENERATE_RUN
    assert data.has_run(["the", "the", "the"]) and not data.has_run(["a", "b", "a", "b"])


# --- data -----------------------------------------------------------------------------------------

def test_sequences_are_bos_prompt_answer_eos_and_fit():
    tok = data.toy_tokenizer()
    rng = random.Random(0)
    for task in data.TOY_TASKS:
        ex = data.toy_example(task, rng)
        prompt, answer = data.encode_example(tok, ex)
        assert prompt[0] == tok.bos_id and answer[-1] == tok.eos_id
        assert len(answer) == len(ex.answer.split()) + 1              # every item is one token
        assert tok.decode(prompt[1:] + answer[:-1]) == ex.prompt + ex.answer
    batch, answer = data.toy_batch(tok, rng, 64, seq_len=train_toy.RunConfig.seq_len)
    assert batch.shape == answer.shape == (64, train_toy.RunConfig.seq_len) and (batch[:, 0] == tok.bos_id).all()
    assert ((batch == tok.eos_id).sum(1) == 1).all()
    last_answer = answer & ~answer.roll(-1, 1)                        # one per row: the <|eos|>
    assert (batch[last_answer] == tok.eos_id).all() and (last_answer.sum(1) == 1).all()
    assert (batch[~answer & (batch != tok.pad_id)] != tok.eos_id).all()   # prompts hold no <|eos|>


def test_every_toy_number_is_one_token():
    tok = data.toy_tokenizer()
    rng = random.Random(0)
    for task in ("count", "count_free"):
        for start in data.COUNT_STARTS:
            for key in [(start, shown) for shown in data.COUNT_SHOWN] if task == "count" else [(start,)]:
                for _ in range(8):                                    # both directions
                    items = data.toy_answer(task, key, rng)
                    assert len(tok.encode(" " + " ".join(items))) == len(items), (task, key, items)
                assert len(tok.encode(data.toy_prompt(task, key))) == len(data.toy_prompt(task, key).split())


@pytest.mark.parametrize("task", data.TOY_TASKS)
def test_heldout_prompts_are_never_trained_on(task):
    rng = random.Random(1)
    train_keys = {data.toy_example(task, rng).key for _ in range(3000)}
    heldout = data.heldout_examples(task, 48)
    assert heldout and all(data.is_heldout(task, ex.key) for ex in heldout)
    assert not any(data.is_heldout(task, key) for key in train_keys)
    assert train_keys.isdisjoint(ex.key for ex in heldout)
    assert len({ex.key for ex in heldout}) == len(heldout)
    assert [ex.prompt for ex in data.heldout_examples(task, 48)] == [ex.prompt for ex in heldout]   # fixed


@pytest.mark.parametrize("task", ["count", "count_free"])
def test_heldout_counts_only_take_steps_seen_in_training(task):
    """A held-out start is new as a prompt, but every step of its count (a -> a+1) was trained on."""
    def steps(ex):
        shown = [int(x) for x in ex.prompt.split()[1:] if x.isdigit()]
        nums = shown + [int(x) for x in ex.answer.split()]
        return set(zip(nums, nums[1:]))
    rng = random.Random(2)
    seen = set().union(*(steps(data.toy_example(task, rng)) for _ in range(5000)))
    for ex in data.heldout_examples(task, 48):
        assert steps(ex) <= seen, ex


# --- the script -----------------------------------------------------------------------------------

def test_a_run_folder_resumes_its_phases_and_refuses_other_settings(tmp_path):
    """The folder keeps its settings (run_config.json, written as JSON: tuples become lists)
    and each finished phase; the same settings load them, other settings are refused with
    every setting that differs named, whatever it is: the model, a schedule, the tasks."""
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    model = train_toy.build_teacher(cfg, data.toy_tokenizer(), "cpu")
    write_json(tmp_path / "run_config.json", asdict(cfg))
    train_toy.save_phase(str(tmp_path), "teacher", train_toy.Phase(model, [{"loss": 1.0}], 2.0))

    done = train_toy.check_run_folder(str(tmp_path), cfg)
    assert list(done) == ["teacher"]
    assert done["teacher"].log == [{"loss": 1.0}]
    loaded = done["teacher"].model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded[name])

    other = {"dim": 32, "warmup_steps": 2, "weight_decay": 0.2, "n_eval": 3,
             "tasks": ("count", "zoo")}
    for name, value in other.items():
        with pytest.raises(train_toy.CliError, match=f"{name} .* -> "):
            train_toy.check_run_folder(str(tmp_path), replace(cfg, **{name: value}))
    with pytest.raises(train_toy.CliError, match=r"dim 64 -> 32, ffn_dim 192 -> 384\)"):
        train_toy.check_run_folder(str(tmp_path), replace(cfg, dim=32, ffn_dim=384))


def test_both_students_train_on_the_same_batches_and_layouts(monkeypatch):
    """naive vs distill is a fair comparison: step by step the same sequences, k and offsets."""
    cfg = train_toy.RunConfig(**{**train_toy.QUICK, "mtp_steps": 3})
    tok = data.toy_tokenizer()
    teacher = train_toy.build_teacher(cfg, tok, "cpu")
    real, layouts = data.random_mtp_layout, []
    monkeypatch.setattr(data, "random_mtp_layout", lambda *a, **kw: layouts.append(real(*a, **kw)) or layouts[-1])
    for name, mode in train_toy.STUDENT_MODE.items():
        student = train_toy.student_from(teacher, "cpu")
        batches = partial(data.toy_batch, tok, tasks=cfg.tasks, seq_len=cfg.seq_len)
        train_toy.train_phase(name, student, cfg, batches, "cpu", mode=mode,
                              tokenizer=train_toy.student_tokenizer())
    assert len(layouts) == 2 * cfg.mtp_steps
    for a, b in zip(layouts[:cfg.mtp_steps], layouts[cfg.mtp_steps:]):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
        assert torch.equal(a.valid, b.valid)
    assert len({layout.input_ids.shape for layout in layouts}) > 1                 # k really is drawn per step


def test_quick_run_end_to_end(tmp_path):
    out, hf = tmp_path / "run", tmp_path / "hf"
    results = train_toy.main(["--quick", "--out", str(out)])
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(results["rows"]))
    rows = on_disk["rows"]
    for row in rows:
        assert ROW_KEYS <= set(row)
        assert row["model"] in train_toy.MODELS and row["decode"] in ("static", "confadapt", "lossless")
        assert row["task"] in data.TOY_TASKS
        for metric in ("accuracy", "coherence", "degeneration"):
            assert 0.0 <= row[metric] <= 1.0
        assert 1.0 <= row["effective_k"] <= max(row["k"], 1)
        assert (row["tau"] is None) == (row["decode"] != "confadapt")
    decodes = {(r["model"], r["decode"]) for r in rows}
    assert decodes == {("ntp", "static")} | {(m, d) for m in ("naive", "distill")
                                             for d in ("static", "confadapt", "lossless")}
    assert {"device", "seconds", "config"} <= set(on_disk)
    assert {"teacher", "naive", "distill", "evaluation", "total"} <= set(on_disk["seconds"])
    # provenance: the commit (None outside git), the CPU, the compute dtype, torch
    assert on_disk["commit"] is None or re.fullmatch("[0-9a-f]{40}", on_disk["commit"])
    assert on_disk["cpu"] and on_disk["dtype"] == "float32" and on_disk["torch"] == torch.__version__
    for png in ("pareto.png", "training_curves.png", "chunks.png"):
        assert (out / png).stat().st_size > 1000, png
    width = int.from_bytes((out / "pareto.png").read_bytes()[16:20], "big")        # the PNG header's width
    assert width == 4 * len(data.BRANCHING_TASKS) * 110                             # a column per branching task

    assert set(on_disk["summary"]) == set(data.TOY_TASKS)
    distill = {(r["decode"], r["tau"], r["task"]): r["accuracy"] for r in rows if r["model"] == "distill"}
    assert on_disk["summary"]["count"]["distill tau=0.9: accuracy"] == distill["confadapt", 0.9, "count"]  # exact

    # --export-hf only exports the finished run: the teacher and both students, named.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert train_toy.main(["--quick", "--out", str(out), "--export-hf", str(hf)])["models"] == ["ntp", "naive",
                                                                                               "distill"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    teacher = Transformer.from_pretrained(hf / "teacher")
    for name in ("naive", "distill"):
        student = Transformer.from_pretrained(hf / name)
        assert teacher.config.mask_token_id is None
        assert student.config.mask_token_id == teacher.config.vocab_size
        assert (hf / name / "tokenizer.json").exists() and (hf / "teacher" / "tokenizer.json").exists()
    tokens = torch.tensor([[1, 2, 3]])
    cfg = train_toy.RunConfig(**train_toy.QUICK)
    checkpoint = train_toy.check_run_folder(str(out), cfg)["teacher"]
    assert torch.allclose(teacher(tokens), checkpoint.model(tokens), atol=1e-5)
