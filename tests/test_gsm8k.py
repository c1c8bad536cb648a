"""tasks/gsm8k.py: GSM8K scored as lm-evaluation-harness's gsm8k_cot scores it, on
hand-written completions, and `finetune_hf.py eval` end to end on a tiny tuned model."""
import json
import re

import pytest
import torch

import finetune_hf
from mtp.engine import Generation
from tasks.word_problems import word_problem_tokenizer
from tasks import gsm8k

# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("completion, gold, strict, flexible, strict_ok, flexible_ok", [
    ("5 + 4 = 9. The answer is 9.", "9",
     "9", "9.", True, True),
    # The strict regex ends in an unescaped ".", which must eat one more character: with
    # nothing after the number, the group gives up its last digit.
    ("So 21 - 15 = 6. The answer is 42", "42",
     "4", "42", False, True),
    # "." does not match a newline either.
    ("The answer is 42\n", "42",
     "4", "42", False, True),
    ("The answer is 42 apples", "42",
     "42", "42", True, True),
    ("The answer is 1,234.", "1234",
     "1,234", "1,234.", True, True),
    ("She pays $1,234.", "1234",
     "[invalid]", "$1,234.", False, True),
    ("The answer is -3.", "-3",
     "-3", "-3.", True, True),
    # Strict takes the first match, flexible the last; followed by more text, the "." is
    # captured (and dropped again by the normalisation).
    ("The answer is 5. The answer is 6.", "6",
     "5.", "6.", False, True),
    ("3 + 4 = 7 apples and 2 pears", "7",
     "[invalid]", "2", False, False),
    ("no number here", "7",
     "[invalid]", "[invalid]", False, False),
    # Everything up to '#### ' is ignored.
    ("The answer is 18.", "#### 18",
     "18", "18.", True, True),
])
def test_gsm8k_scoring(completion, gold, strict, flexible, strict_ok, flexible_ok):
    """score() extracts and compares as lm-evaluation-harness's gsm8k_cot does, its
    quirks included."""
    s = gsm8k.score(completion, gold)
    assert (s["strict"], s["flexible"]) == (strict, flexible)
    assert (s["strict_ok"], s["flexible_ok"]) == (strict_ok, flexible_ok)


def test_the_fewshot_prompt_is_eight_exemplars_then_the_question():
    """Wei et al.'s 8 exemplars, each "Q: ... A: ...", then the question, as gsm8k_cot
    writes them."""
    prompt = gsm8k.fewshot_prompt("How many?")
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert prompt.endswith("The answer is 8.\n\nQ: How many?\nA:")
    assert prompt.count("Q: ") == 9
    assert prompt.count("\n\n") == 8


def test_a_completion_ends_at_its_first_stop_string_counted_to_the_end_of_its_pass():
    """Stopping at a stop STRING: count tokens and passes up to the end of the pass that
    completed it. The first stop string cuts; a stop TOKEN is dropped from the text."""
    tok = word_problem_tokenizer()
    first = tok.encode("x. The answer is 3.\n\nQ: next</s>")
    gen = Generation(first, [len(first)], False)
    text = gsm8k.completion_of(tok, gen, set())[0]
    assert text == "x. The answer is 3.\n\n"

    ids = tok.encode("Tom has 3. The answer is: 3\n\nQ: Ann has 5 more")
    # The tokens through "Q:".
    q_at = next(i for i in range(len(ids))
                if "Q:" in tok.decode(ids[: i + 1])) + 1
    # Passes of 3 tokens; the last one may be shorter.
    sizes = [3] * (len(ids) // 3)
    if len(ids) % 3:
        sizes.append(len(ids) % 3)
    gen = Generation(ids, sizes, False)
    text, n_tokens, passes = gsm8k.completion_of(tok, gen, stop_ids={tok.eos_id})
    assert text == "Tom has 3. The answer is: 3\n\n"
    assert passes == -(-q_at // 3)
    assert n_tokens == min(3 * passes, len(ids))

    # A stop TOKEN is dropped from the text.
    eos_ended = Generation(ids[:5] + [tok.eos_id], [4, 2], True)
    completion = gsm8k.completion_of(tok, eos_ended, stop_ids={tok.eos_id})
    assert completion == (tok.decode(ids[:5]), 6, 2)


def test_mean_and_stderr_like_the_harness():
    """The standard error is the sample standard deviation over sqrt(n)."""
    mean, se = gsm8k.mean_and_stderr([1, 0, 1, 1])
    # The sample std 0.5 / sqrt(4).
    assert mean == 0.75
    assert se == pytest.approx(0.25)


@pytest.fixture(scope="module")
def sweep(one_thread_for_module, tiny_hf, tmp_path_factory):
    """`eval` of a model tuned for one step (so it has <mask>) over greedy, static k,
    ConfAdapt and lossless: (the eval's argv without its decoders, its --out)."""
    root = tmp_path_factory.mktemp("gsm8k")
    train = ["train", "--model", str(tiny_hf / "base"),
             "--data", str(tiny_hf / "wp" / "train.json"), "--out", str(root / "m"),
             "--seq-len", "48", "--batch-size", "4", "--micro-batch", "2", "--k-max", "6",
             "--steps", "1", "--dtype", "float32"]
    assert finetune_hf.main(train) == 0
    out = root / "eval"
    common = ["eval", "--model", str(root / "m" / "final"),
              "--data", str(tiny_hf / "wp" / "test.jsonl"), "--out", str(out),
              "--max-new-tokens", "6", "--batch-size", "2"]
    decoders = ["--prompt-style", "zeroshot",
                "--static-k", "1", "3", "--taus", "0.9", "--lossless-k", "4"]
    assert finetune_hf.main(common + decoders) == 0
    return common, out


def test_eval_records_what_its_figures_depend_on(sweep):
    """results.json's meta: the commit (None outside git), the CPU, the dtype, torch."""
    _, out = sweep
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["commit"] is None or re.fullmatch("[0-9a-f]{40}", meta["commit"])
    assert meta["cpu"]
    assert meta["dtype"] in ("float32", "bfloat16")
    assert meta["device"] == "cpu"
    assert meta["torch"] == torch.__version__


def test_eval_sweeps_every_decoder_into_table_samples_and_plot(sweep):
    """One row per decoder, in order; greedy makes one token per pass, static k=3 more;
    lossless is as accurate as greedy."""
    _, out = sweep
    res = json.loads((out / "results.json").read_text())["results"]
    # ConfAdapt at the k_max the model was trained with (train --k-max 6)
    decoders = ["k=1 (greedy)", "static k=3", "confadapt tau=0.9 k_max=6", "lossless k=4"]
    assert [r["decoding"] for r in res] == decoders
    assert res[0]["effective_k_mean"] == 1.0
    assert res[1]["effective_k_mean"] > 1.0
    assert res[3]["flexible_acc"] == res[0]["flexible_acc"]
    # The gold answer: after '####'.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["gold"].isdigit()
    assert "| static k=3 |" in (out / "results.md").read_text()
    assert (out / "pareto.png").stat().st_size > 0


def test_eval_replaces_an_earlier_eval_only_with_overwrite(sweep):
    """An 8-shot prompt, into an --out that holds an earlier eval."""
    common, _ = sweep
    again = common + ["--limit", "1", "--static-k", "1", "--taus"]
    assert finetune_hf.main(again) == 2
    assert finetune_hf.main(again + ["--overwrite"]) == 0


def test_a_paired_difference_counts_won_and_lost_questions():
    """Won: right here, wrong there; lost: the reverse; the difference in accuracy and its
    standard error are those of the per-question differences."""
    ours = [True, True, True, False, True, False, False, False, True, False]
    theirs = [False, False, True, True, True, False, False, False, False, False]
    paired = gsm8k.paired_difference(ours, theirs)
    assert (paired["won"], paired["lost"]) == (3, 1)
    # differences: three +1, one -1, six 0: mean 0.2, sample std sqrt((3 * 0.64 + 1.44
    # + 6 * 0.04) / 9) = 0.6325, over sqrt(10)
    assert paired["difference"] == pytest.approx(0.2)
    assert paired["difference_se"] == pytest.approx(0.2)


def test_eval_against_a_reference_prints_won_lost_and_the_paired_difference(sweep, tmp_path,
                                                                            capsys):
    """--reference: each decoder's won and lost questions against the reference's k=1 answers,
    and the paired difference in accuracy with its standard error, in results.json, results.md
    and the printed table."""
    common, _ = sweep
    zeroshot = ["--prompt-style", "zeroshot"]
    first = tmp_path / "first"
    argv = common + zeroshot + ["--out", str(first), "--static-k", "1", "--taus"]
    assert finetune_hf.main(argv) == 0
    greedy = [json.loads(line) for line in (first / "samples.jsonl").read_text().splitlines()]
    # the reference: this model's k=1 answers, the first three marked right and the fourth
    # wrong whatever they were, and the first one's text changed
    right = {r["index"]: r["flexible_ok"] for r in greedy}
    for r in greedy:
        r["flexible_ok"] = {0: True, 1: True, 2: True, 3: False}.get(r["index"], r["flexible_ok"])
    greedy[0]["completion"] += " changed"
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in greedy))
    capsys.readouterr()
    argv = common + zeroshot + ["--out", str(tmp_path / "eval"), "--reference", str(reference),
                     "--static-k", "1", "--taus", "0.9"]
    assert finetune_hf.main(argv) == 0
    printed = capsys.readouterr().out
    res = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    lines = (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()
    ours = [json.loads(line) for line in lines]
    theirs = {r["index"]: r["flexible_ok"] for r in greedy}
    md = (tmp_path / "eval" / "results.md").read_text()
    assert "| won / lost | paired difference |" in md
    for row in res:
        mine = {s["index"]: s["flexible_ok"] for s in ours if s["decoding"] == row["decoding"]}
        won = sum(mine[i] and not theirs[i] for i in mine)
        lost = sum(theirs[i] and not mine[i] for i in mine)
        paired = row["vs_reference"]
        assert (paired["won"], paired["lost"]) == (won, lost)
        assert paired["difference"] == pytest.approx((won - lost) / len(mine))
        diffs = [int(mine[i]) - int(theirs[i]) for i in sorted(mine)]
        assert paired["difference_se"] == pytest.approx(gsm8k.mean_and_stderr(diffs)[1])
        line = (f" {won} / {lost} | {100 * paired['difference']:+.1f} ± "
                f"{100 * paired['difference_se']:.1f} |")
        assert line in md and line in printed
    # greedy answers as the reference, so it wins and loses exactly where the marks changed
    greedy_row = res[0]["vs_reference"]
    changed = (int(right[3]), sum(not right[i] for i in range(3)))
    assert (greedy_row["won"], greedy_row["lost"]) == changed
    # greedy is the reference's k=1 but for the first answer's text
    assert res[0]["same_as_reference"] == pytest.approx(1 - 1 / len(greedy))
