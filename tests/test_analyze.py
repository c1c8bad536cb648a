"""mtp/analyze.py, the `analyze` command: ConfAdapt simulated on hand-made confidences, the
report and its verdict computed from them, then `finetune_hf.py analyze` end to end on a tiny
checkpoint, on a file and on domains."""
import json
import shutil

import pytest

import finetune_hf
from mtp.analyze import predictability, simulated_passes

# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def test_simulated_passes_stop_where_confadapt_would():
    """A pass keeps the leading tokens that clear tau, at least one, at most k_max: per
    token, or with the joint probability of the run."""
    # [0.5] [.95 .95] [0.5]: a pass stops at an unsure token.
    conf = [0.5, 0.95, 0.95, 0.5]
    assert simulated_passes(conf, 0.9, 16, joint=False) == 3
    assert simulated_passes(conf, 0.9, 16, joint=True) == 3
    # [.95 .95 .95 .95]
    assert simulated_passes([0.95] * 4, 0.9, 16, joint=False) == 1
    # [.95 .95] [.95 .95]: .95^3 < 0.9
    assert simulated_passes([0.95] * 4, 0.9, 16, joint=True) == 2
    # k_max caps a pass.
    assert simulated_passes([1.0] * 10, 0.9, 4, joint=True) == 3


def test_a_gated_adapters_ceiling_is_gated_by_the_untuned_models_own_confidence():
    """With a gated adapter a pass's first prediction is the untuned model's: where it is
    at least tau sure, the pass keeps k_max tokens at best (every mask guess sure), where
    not, one, however sure the tokens after it are."""
    # [.95 .2 .2 .2] [.5] [.95 .95]: k_max 4, the last pass cut by the answer's end
    conf = [0.95, 0.2, 0.2, 0.2, 0.5, 0.95, 0.95]
    assert simulated_passes(conf, 0.9, 4, joint=False, gated=True) == 3
    # per token the same answer takes 1 + 1 + 1 + 1 + 1 + 1 passes
    assert simulated_passes(conf, 0.9, 4, joint=False) == 6
    # an unsure first token: one token a pass, even if all after it are sure
    assert simulated_passes([0.5] + [0.99] * 3, 0.9, 4, joint=False, gated=True) == 2
    assert simulated_passes([0.5] * 3, 0.9, 4, joint=False, gated=True) == 3


def test_predictability_is_tokens_per_simulated_pass_with_the_verdict_of_tau_0_9():
    """Effective k = answer tokens / simulated passes over all answers, per token (the
    optimistic bound) and joint (the conservative one); the verdict reads tau 0.9."""
    confs = [[0.95] * 4, [0.5, 0.95, 0.95, 0.5]]
    report = predictability(confs, [0.9, 0.5], k_max=16)
    assert (report["answers"], report["tokens"]) == (2, 8)
    assert report["mean_confidence"] == pytest.approx(6.7 / 8)
    at_09, at_05 = report["estimates"]
    # Per token 1 + 3 passes, joint 2 + 3 (see the test above).
    assert at_09["effective_k_per_token"] == 8 / 4
    assert at_09["effective_k_joint"] == 8 / 5
    assert at_09["share_confident"] == 6 / 8
    # gated ceiling, k_max 16: [.95 .95 .95 .95] and [.5] [.95 .95 .5]
    assert at_09["effective_k_gated_ceiling"] == 8 / 3
    # tau 0.5: per token [4] [4]; joint [4] [0.5] [.95 .95] [0.5], as .5 * .95 < 0.5.
    assert at_05["effective_k_per_token"] == 8 / 2
    assert at_05["effective_k_joint"] == 8 / 4
    # 2 tokens per pass at tau 0.9: worth tuning; 4 tokens in 3 passes: a floor.
    assert report["worth_tuning"]
    assert "predictable enough to be worth tuning" in report["verdict"]
    unsure = predictability(confs[1:], [0.9], k_max=16)
    assert not unsure["worth_tuning"]
    assert "a floor: tuning sharpens confidences" in unsure["verdict"]


@pytest.fixture(scope="module")
def analysis(one_thread_for_module, tiny_hf, tmp_path_factory):
    """`analyze` of the base model's answers to a file's first 2 prompts: its --out."""
    out = tmp_path_factory.mktemp("analyze") / "an"
    argv = ["analyze", "--model", str(tiny_hf / "base"),
            "--data", str(tiny_hf / "wp" / "test.jsonl"),
            "--limit", "2", "--max-new-tokens", "4", "--taus", "0.9",
            "--out", str(out)]
    assert finetune_hf.main(argv) == 0
    return out


def test_analyze_writes_the_estimates_of_a_file_of_prompts(analysis):
    """analysis.json holds the file's estimates; analysis.md shows the same figures."""
    whole = json.loads((analysis / "analysis.json").read_text())
    # what its figures were computed in
    assert whole["device"] == "cpu" and whole["dtype"] in ("float32", "bfloat16")
    report = whole["domains"]["test.jsonl"]
    assert report["answers"] == 2
    assert report["tokens"] > 0
    est = report["estimates"][0]
    row = (f"| test.jsonl | 2 | {report['tokens']} | {report['mean_confidence']:.3f} "
           f"| {est['effective_k_joint']:.2f}-{est['effective_k_per_token']:.2f} |")
    md = (analysis / "analysis.md").read_text()
    assert row in md
    ceiling = est["effective_k_gated_ceiling"]
    assert f"test.jsonl: a gated adapter on this model keeps at most {ceiling:.2f} at tau 0.9" in md


def test_analyze_of_domains_replaces_an_earlier_analysis_only_with_overwrite(
        tiny_hf, analysis, tmp_path):
    """Domain prompts generated in code, one report per domain and tau, into an --out that
    holds an earlier analysis."""
    out = tmp_path / "an"
    shutil.copytree(analysis, out)
    again = ["analyze", "--model", str(tiny_hf / "base"),
             "--domains", "lists", "word_problems",
             "--limit", "2", "--max-new-tokens", "4", "--taus", "0.9", "0.5",
             "--out", str(out)]
    assert finetune_hf.main(again) == 2
    assert finetune_hf.main(again + ["--overwrite"]) == 0
    report = json.loads((out / "analysis.json").read_text())["domains"]
    assert list(report) == ["lists", "word_problems"]
    assert len(report["lists"]["estimates"]) == 2
    assert "| lists | 2 |" in (out / "analysis.md").read_text()
