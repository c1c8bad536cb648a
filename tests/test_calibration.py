"""Temperature calibration of a gated mask adapter (mtp/calibration.py): the fit lowers the
held-out calibration error of under-confident predictions, the temperatures go into the
adapter's folder and come back with it, decoding reads them for ConfAdapt's confidences only,
--no-calibration leaves them out, and finetune_hf.py calibrate refuses bad input in one line."""
import json
import math

import pytest
import torch

import confadapt
import finetune_hf
from adapter import ADAPTER_CONFIG, adapter_state, add_mask_adapter, save_mask_adapter
from confadapt import DecodeConfig
from model import add_mask_token
from mtp.calibration import BINS, Tally, set_mask_temperatures, slot_temperatures
from mtp.cli import load, load_model, load_tokenizer
from mtp.engine import generate, syncs_per_pass
from mtp.finetune_cli import build_parser
from mtp.hf import from_pretrained

# conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


# --- the fit ---

def predictions(scale, n=3000, vocab=20, seed=0):
    """Predictions whose right tokens are drawn from softmax(z), so softmax(z) is calibrated;
    returned as z * scale: scale < 1 is under-confident, and T = scale undoes it."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g) * 3
    right = torch.multinomial(z.softmax(-1), 1, generator=g)[:, 0]
    return z * scale, right


def plain_ece(logits, right):
    """ECE written out directly, at T = 1: 15 equal-width bins of the top-1 probability."""
    conf, pred = logits.softmax(-1).max(-1)
    hit = (pred == right).float()
    total = 0.0
    for b in range(BINS):
        inside = (conf >= b / BINS) & (conf < (b + 1) / BINS) if b < BINS - 1 else conf >= b / BINS
        if inside.any():
            total += inside.sum() / len(conf) * (hit[inside].mean() - conf[inside].mean()).abs()
    return float(total)


def test_the_fit_finds_the_temperature_and_lowers_held_out_ece():
    # slot 1 under-confident (logits scaled by 0.4), slot 2 over-confident (by 2)
    scales = (0.4, 2.0)
    fitted = Tally(2)
    for j, s in enumerate(scales):
        fitted.add(j, *predictions(s, seed=j))
    fit = fitted.fit()
    for T, s in zip(fit["temperatures"], scales):
        assert abs(math.log(T / s)) < 0.1

    held_out = Tally(2)
    for j, s in enumerate(scales):
        logits, right = predictions(s, seed=10 + j)
        held_out.add(j, logits, right)
        # the tally's ECE at T = 1 is the one written out
        assert plain_ece(logits, right) == pytest.approx(
            held_out.fit()["ece_before_per_slot"][j], abs=1e-6)
    measured = held_out.fit(fit["temperatures"])
    assert measured["temperatures"] == fit["temperatures"]
    for before, after in zip(measured["ece_before_per_slot"], measured["ece_after_per_slot"]):
        assert before > 0.1
        assert after < before / 3
    assert measured["ece_after"] < measured["ece_before"] / 3
    # under-confident: calibration raises the confidences, over-confident: lowers them
    assert measured["confidence_after"][0] > measured["confidence_before"][0]
    assert measured["confidence_after"][1] < measured["confidence_before"][1]


def test_slots_beyond_the_calibrated_ones_take_the_last_temperature():
    model = torch.nn.Module()
    model.tok_emb = torch.nn.Embedding(4, 2)
    set_mask_temperatures(model, None)
    assert slot_temperatures(model, 5) is None
    set_mask_temperatures(model, [0.5, 0.7])
    assert slot_temperatures(model, 5).tolist() == pytest.approx([1.0, 0.5, 0.7, 0.7, 0.7])
    assert slot_temperatures(model, 2).tolist() == [1.0, 0.5]
    # no part of the saved state
    assert "mask_temperatures" not in model.state_dict()


# --- a tiny adapter folder and the command ---

@pytest.fixture
def folders(tiny_hf, tmp_path):
    """(base folder, adapter folder of a trained-looking tiny adapter, held-out rows)."""
    base = tiny_hf / "base"
    model = from_pretrained(base)
    add_mask_token(model, load_tokenizer(base))
    add_mask_adapter(model, rank=2, alpha=4.0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    adapter = tmp_path / "adapter"
    save_mask_adapter(model, adapter, base)
    return base, adapter, tiny_hf / "wp" / "train.json"


def calibrate(adapter, data, *more):
    return finetune_hf.main(["calibrate", "--model", str(adapter), "--data", str(data),
                             "--k-max", "4", "--seq-len", "48", "--limit-rows", "16",
                             "--dtype", "float32", *more])


def test_calibrate_writes_temperatures_that_load_with_the_folder(folders, capsys):
    base, adapter, data = folders
    before = json.loads((adapter / ADAPTER_CONFIG).read_text())
    # a folder without temperatures loads without them
    plain = load_model(adapter)[0]
    assert plain.mask_temperatures is None

    assert calibrate(adapter, data) == 0
    out = capsys.readouterr().out
    assert "all slots (their mean, weighted by predictions): ECE" in out
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    record = config.pop("calibration")
    # the rest of the config as it was
    assert config == before
    temps = record["temperatures"]
    assert len(temps) == 3 and all(t > 0 for t in temps)
    assert record["rows"] == 16 and record["k"] == 4
    assert sum(record["predictions"]) > 0
    assert f"{record['ece_before']:.3f} -> {record['ece_after']:.3f}" in out
    n = record["predictions"]
    mean = sum(e * c for e, c in zip(record["ece_after_per_slot"], n)) / sum(n)
    assert record["ece_after"] == pytest.approx(mean)
    # no slot's calibration error on the rows grows (a slot the fit does not help keeps T = 1)
    for before, after, T in zip(record["ece_before_per_slot"], record["ece_after_per_slot"],
                                temps):
        assert after < before or (after == before and T == 1.0)

    model = load_model(adapter)[0]
    assert model.mask_temperatures.tolist() == pytest.approx([1.0, *temps])
    # the same weights as without: the temperatures are no tensor of the adapter
    assert adapter_state(model).keys() == adapter_state(plain).keys()
    assert load_model(adapter, calibrated=False)[0].mask_temperatures is None


def test_check_measures_the_fitted_temperatures_on_rows_the_fit_did_not_see(folders, tmp_path,
                                                                           capsys):
    """--check: the fit's temperatures, unchanged, on other rows (all of them): there, ECE
    before is those rows' own (what a fit on them alone starts from), after is at the fit's
    temperatures, not theirs."""
    _, adapter, data = folders
    rows = json.loads(data.read_text())
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows[16:40]))
    assert calibrate(adapter, data, "--check", str(other)) == 0
    out = capsys.readouterr().out
    record = json.loads((adapter / ADAPTER_CONFIG).read_text())["calibration"]
    check = record["check"]
    assert check["rows"] == 24 and check["data"] == [str(other)]
    assert check["temperatures"] == record["temperatures"]
    assert "the same temperatures on --check's 24 rows, not fitted on:" in out
    assert f"{check['ece_before']:.3f} -> {check['ece_after']:.3f}" in out

    # the other rows fitted on their own: the same ECE before, their own temperatures
    assert calibrate(adapter, other, "--limit-rows", "0", "--force") == 0
    alone = json.loads((adapter / ADAPTER_CONFIG).read_text())["calibration"]
    assert alone["rows"] == 24 and "check" not in alone
    assert alone["predictions"] == check["predictions"]
    assert alone["ece_before"] == pytest.approx(check["ece_before"])
    assert record["ece_before"] != pytest.approx(check["ece_before"])


def test_no_calibration_leaves_the_temperatures_out(folders):
    _, adapter, data = folders
    assert calibrate(adapter, data) == 0
    mode = DecodeConfig("confadapt", tau=0.9, k_max=4)
    argv = ["--model", str(adapter), "--prompt", "Tom has 3 apples.", "--dtype", "float32"]
    on = load(confadapt.parser().parse_args(argv), mode)[0]
    off = load(confadapt.parser().parse_args([*argv, "--no-calibration"]), mode)[0]
    assert on.mask_temperatures is not None
    assert off.mask_temperatures is None
    # finetune_hf.py's decoding commands take the flag too
    eval_argv = ["eval", "--model", str(adapter), "--data", "x.jsonl", "--no-calibration"]
    assert build_parser().parse_args(eval_argv).no_calibration


@pytest.mark.parametrize("problem", ["not an adapter", "missing data", "missing check",
                                     "calibrated already", "bad temperatures"])
def test_calibrate_refuses_bad_input_in_one_line(folders, problem, capsys):
    base, adapter, data = folders
    model = adapter
    more = ()
    if problem == "not an adapter":
        model = base
    elif problem == "missing data":
        data = data.parent / "nowhere.jsonl"
    elif problem == "missing check":
        more = ("--check", str(data.parent / "nowhere.jsonl"))
    elif problem == "calibrated already":
        assert calibrate(adapter, data) == 0
        capsys.readouterr()
    else:
        config = json.loads((adapter / ADAPTER_CONFIG).read_text())
        config["calibration"] = {"temperatures": [1.0, -2.0]}
        (adapter / ADAPTER_CONFIG).write_text(json.dumps(config))
    written = (adapter / ADAPTER_CONFIG).read_text()
    if problem == "bad temperatures":
        # decoding refuses the folder; calibrate --force replaces the field
        with pytest.raises(ValueError, match="positive numbers"):
            load_model(adapter)
        assert calibrate(adapter, data, "--force") == 0
        assert json.loads((adapter / ADAPTER_CONFIG).read_text())["calibration"]["k"] == 4
        return
    assert calibrate(model, data, *more) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert (adapter / ADAPTER_CONFIG).read_text() == written
    if problem == "calibrated already":
        assert "--force" in err
        assert calibrate(adapter, data, "--force") == 0


# --- decoding ---

def test_calibration_moves_only_what_confadapt_keeps(folders):
    _, adapter, _ = folders
    model, tok, mask_id, _ = load_model(adapter)
    # sharper logits: prediction 0 (never scaled) clears tau in every pass
    with torch.no_grad():
        model.norm.weight.mul_(100)
    prompts = [tok.encode("Tom has 3 apples and buys"), tok.encode("Ann reads 12 pages")]
    greedy = DecodeConfig("static", k=1)
    lossless = DecodeConfig("lossless", k=4)
    confadapt_mode = DecodeConfig("confadapt", tau=0.9, k_max=6)

    def run(temperatures, mode):
        set_mask_temperatures(model, temperatures)
        gens, _ = generate(model, prompts, 16, mode)
        lesson = confadapt.generate(model, prompts, 16, mode)
        uncached = [confadapt.generate_uncached(model, p, 16, mode) for p in prompts]
        # the engine, the lesson's cached decoder and the definition agree
        assert [(g.tokens, g.chunk_sizes) for g in gens] == lesson
        assert lesson == uncached
        return lesson

    # sure of every mask guess (T small), and unsure of all (T large)
    for mode in (greedy, lossless):
        assert run(None, mode) == run([0.01] * 3, mode) == run([100.0] * 3, mode)
    sure = run([0.01] * 3, confadapt_mode)
    unsure = run([100.0] * 3, confadapt_mode)
    # T = 100 flattens every mask prediction below tau: one token a pass, greedy's
    assert all(set(chunks) == {1} for _, chunks in unsure)
    assert [tokens for tokens, _ in unsure] == [tokens for tokens, _ in run(None, greedy)]
    # T = 0.01 makes every mask guess sure: k_max tokens wherever prediction 0 clears tau
    for (_, many), (_, one) in zip(sure, unsure):
        assert max(many) == 6 and len(many) < len(one) / 2


def test_calibrated_passes_wait_for_the_device_no_more_often(folders):
    """The temperatures are made on the device each pass: no copy, no read."""
    _, adapter, _ = folders
    model, tok, _, _ = load_model(adapter)
    prompts = [tok.encode("Tom has 3 apples and buys"), tok.encode("Ann reads 12 pages")]
    mode = DecodeConfig("confadapt", tau=0.9, k_max=6)
    counts = []
    for temperatures in (None, [0.5, 0.7, 0.9]):
        set_mask_temperatures(model, temperatures)
        counts.append(set(syncs_per_pass(model, prompts, 12, mode)[0]))
    assert counts[0] == counts[1]
