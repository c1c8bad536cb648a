"""Temperature calibration of a gated mask adapter's mask predictions: finetune_hf.py's
`calibrate` command, and the temperatures decoding reads. Support code; a learner can skip it.

ConfAdapt keeps prediction j of a pass while its confidence (its top-1 softmax probability)
clears tau. A gated adapter's mask predictions are right (they are the teacher's token, the
target it trains on) more often than their confidences say, so ConfAdapt keeps fewer than it
could. Temperature scaling (Guo et al. 2017) corrects that after training, with one number
per mask slot: prediction j >= 1 reads its confidence from softmax(logits / T_j), T_j the
temperature that minimises the negative log-likelihood (NLL) of the right token on held-out
rows. Dividing by T_j > 0 keeps the argmax: greedy and lossless output stay as they are, only
what ConfAdapt keeps moves. Prediction 0, the model's own next token, is never scaled.

How well confidences match is the expected calibration error (ECE): the gap between mean
confidence and accuracy in each of 15 equal-width confidence bins, weighted by the bin's share
of the predictions; over all slots, the slots' ECEs weighted by their predictions.

The fit streams over the rows: for each temperature of a grid (log T from -2 to 2 in steps of
0.04), each slot's summed NLL and its ECE bins are added up batch by batch, so no logits are
kept (a SmolLM2 row holds about 240 mask predictions of 49,152 logits each). T_j is the grid's
best, within 2% of the exact minimum. A slot whose ECE on the rows that T_j does not lower
keeps T_j = 1: the NLL also weighs how unlikely the right token is where the guess is wrong,
which the ECE does not see, so on few rows or a little-trained adapter the two can disagree.

`--check ROWS` measures the fitted temperatures on rows the fit did not see (a fit on few rows
can lower the ECE of those rows alone), stored beside the fit.

The temperatures live in the adapter's mask_adapter.json ("calibration"); a folder without
them loads as before. A pass with more mask slots than were calibrated gives the extra ones
the last slot's temperature.
"""

import argparse
import math
import os
import sys

import torch

from mtp.hf import read_json, write_json

BINS = 15
# the temperatures tried: T = exp(x) for x from -2 to 2 in steps of 0.04 (T from 0.14 to 7.4)
LOG_T_GRID = torch.linspace(-2.0, 2.0, 101)
CALIBRATION = "calibration"


# --- the temperatures in a folder and on a model ---

def config_temperatures(config: dict, path) -> list[float] | None:
    """The per-slot temperatures [T_1, .., T_{k-1}] of an adapter's config (None without
    any), checked."""
    record = config.get(CALIBRATION)
    if record is None:
        return None
    temps = record.get("temperatures") if isinstance(record, dict) else None
    good = isinstance(temps, list) and temps and all(
        isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps)
    if not good:
        raise ValueError(f"{os.path.join(path, 'mask_adapter.json')}: calibration.temperatures "
                         "must be a list of positive numbers (remove the calibration field, or "
                         "run finetune_hf.py calibrate --force)")
    return [float(t) for t in temps]


def set_mask_temperatures(model, temperatures):
    """Give `model` per-slot temperatures (None or falsy: none), as a buffer that moves with
    the model and is no part of its saved state: (k,), 1 for prediction 0, then T_1 ..
    T_{k-1}."""
    row = None
    if temperatures:
        row = torch.tensor([1.0, *temperatures], device=model.tok_emb.weight.device)
    model.register_buffer("mask_temperatures", row, persistent=False)


def slot_temperatures(model, n: int):
    """The temperature of each of a pass's n predictions (n,), on the model's device, or None
    where the model has none. Slots beyond the calibrated ones take the last one. Made on the
    device, so a pass waits for no copy."""
    temps = getattr(model, "mask_temperatures", None)
    if temps is None:
        return None
    # prediction j takes temperature min(j, k - 1)
    slots = torch.arange(n, device=temps.device).clamp(max=len(temps) - 1)
    return temps.float()[slots]


# --- the fit ---

class Tally:
    """Per mask slot j (0-based: prediction j + 1) and grid temperature g: the summed NLL
    and, per confidence bin, the predictions, their summed confidence and the right ones."""

    def __init__(self, slots: int):
        G = len(LOG_T_GRID)
        self.nll = torch.zeros(slots, G, dtype=torch.float64)
        self.count = torch.zeros(slots, G, BINS, dtype=torch.float64)
        self.confidence = torch.zeros(slots, G, BINS, dtype=torch.float64)
        self.right = torch.zeros(slots, G, BINS, dtype=torch.float64)

    def add(self, j: int, logits, targets):
        """Slot j's predictions: logits (P, V) float32, the right tokens (P,)."""
        right = (logits.argmax(-1) == targets).double()                    # (P,)
        top = logits.max(-1).values
        target = logits.gather(1, targets[:, None])[:, 0]
        for g, log_t in enumerate(LOG_T_GRID.tolist()):
            T = math.exp(log_t)
            lse = torch.logsumexp(logits / T, dim=-1)                      # (P,)
            self.nll[j, g] += (lse - target / T).double().sum().cpu()
            conf = torch.exp(top / T - lse).double().cpu()
            bins = (conf * BINS).long().clamp(max=BINS - 1)
            self.count[j, g].index_add_(0, bins, torch.ones_like(conf))
            self.confidence[j, g].index_add_(0, bins, conf)
            self.right[j, g].index_add_(0, bins, right.cpu())

    def fit(self, temperatures=None) -> dict:
        """Each slot's best temperature and what it does to the ECE, per slot and over all.
        temperatures: those of another fit, measured here (held-out rows) instead."""
        best = self.nll.argmin(1)                                          # (slots,)
        one = int((LOG_T_GRID.abs()).argmin())
        tables = (self.count, self.confidence, self.right)
        if temperatures is None:
            # a slot whose calibration error its best NLL does not lower keeps T = 1
            for j, g in enumerate(best.tolist()):
                if ece(*(t[j, g] for t in tables)) >= ece(*(t[j, one] for t in tables)):
                    best[j] = one
        else:
            # the grid's nearest, slots beyond them taking the last one
            logs = torch.tensor([math.log(temperatures[min(j, len(temperatures) - 1)])
                                 for j in range(len(best))])
            best = (LOG_T_GRID[None] - logs[:, None]).abs().argmin(1)
        slots = range(len(best))

        def pick(table, g):
            # (slots, BINS): each slot's bins at its own grid index
            return torch.stack([table[j, g[j]] for j in slots])

        before = [pick(t, [one] * len(best)) for t in tables]
        after = [pick(t, best.tolist()) for t in tables]
        n = before[0].sum(1)
        ece_before = ece(*before)
        ece_after = ece(*after)
        return {
            "temperatures": [round(math.exp(LOG_T_GRID[g]), 4) for g in best.tolist()],
            "predictions": [int(x) for x in n.tolist()],
            "accuracy": (before[2].sum(1) / n).tolist(),
            "confidence_before": (before[1].sum(1) / n).tolist(),
            "confidence_after": (after[1].sum(1) / n).tolist(),
            "ece_before_per_slot": ece_before.tolist(),
            "ece_after_per_slot": ece_after.tolist(),
            # the slots' mean, weighted by their predictions: bins pooled over the slots
            # would let one slot's over-confidence hide another's under-confidence
            "ece_before": float((ece_before * n).sum() / n.sum()),
            "ece_after": float((ece_after * n).sum() / n.sum()),
        }


def ece(count, confidence, right):
    """The expected calibration error of bins (..., BINS): sum over bins of |right -
    confidence| / predictions."""
    return (right - confidence).abs().sum(-1) / count.sum(-1).clamp(min=1)


@torch.no_grad()
def tally(model, batches, mask_id=None) -> Tally:
    """Every valid mask prediction (j >= 1) of `batches` (MTPBatch, on the model's device):
    the student's logits and the teacher's argmax, as gated_mtp_loss's hard mode scores them.
    <mask> is never an output, as in decoding (nor a target)."""
    # adapter.py imports this module (for the temperatures): imported when the fit runs
    from adapter import gated_predictions
    result = None
    for batch in batches:
        logits, _, targets, _ = gated_predictions(model, batch, "hard")  # (B, M, k, V)
        k = logits.shape[2]
        result = result or Tally(k - 1)
        if mask_id is not None:
            logits[..., mask_id] = float("-inf")
        for j in range(1, k):
            valid = batch.valid[:, :, j]                                    # (B, M)
            if mask_id is not None:
                valid = valid & (targets[:, :, j] != mask_id)
            if valid.any():
                result.add(j - 1, logits[:, :, j][valid], targets[:, :, j][valid])
    return result


# --- the command ---

def calibrate(args):
    """finetune_hf.py calibrate: fit the temperatures of --model's mask slots on --data's
    rows, print ECE before and after per slot, and write them into its mask_adapter.json."""
    # confadapt.py (through adapter.py) imports this module: the command's own imports run
    # when it does
    from data import default_n_regions, mtp_layout
    from mtp.distributed import Dist
    from mtp.finetune_cli import load_for_inference
    from mtp.tokenizer import padding_token, training_sequences
    from mtp.training_rows import training_pairs

    # the fit reads the plain logits: any earlier temperatures (--force) stay unread
    args.no_calibration = True
    model, tok, mask_id, fmt, _ = load_for_inference(args)
    k = args.k_max
    pad = padding_token(tok, fmt)
    regions = default_n_regions(args.seq_len, k)
    region_len = args.seq_len // regions
    device = model.tok_emb.weight.device

    def tallied(data, limit_rows) -> tuple[Tally, int]:
        """The mask predictions of `data`'s rows, laid out as train lays them, and the rows."""
        pairs = training_pairs(argparse.Namespace(data=data, limit_rows=limit_rows), Dist())
        # the answers' tokens only: what ConfAdapt's masks guess when decoding
        seqs, response = training_sequences(pairs, tok, fmt, args.seq_len)

        def batches():
            for i, first in enumerate(range(0, len(seqs), args.batch_size)):
                rows = seqs[first:first + args.batch_size].long()
                trained = response[first:first + args.batch_size]
                # the offsets cycle, so every place of a region is a prefix end somewhere
                yield mtp_layout(rows, k=k, offset=i % region_len, n_regions=regions,
                                 mask_id=mask_id, eos_id=pad, pad_id=pad,
                                 trained=trained).to(device)
                print(f"  {first + len(rows)}/{len(seqs)} rows", file=sys.stderr, flush=True)

        return tally(model, batches(), mask_id), len(seqs)

    def measured(data, limit_rows=0, temperatures=None) -> tuple[dict, int]:
        seen, rows = tallied(data, limit_rows)
        fit = seen.fit(temperatures)
        if min(fit["predictions"]) == 0:
            slot = fit["predictions"].index(0) + 1
            raise ValueError(f"the rows of {' '.join(data)} give mask slot {slot} nothing to "
                             "predict: give more rows, or longer ones (--seq-len)")
        return fit, rows

    fit, rows = measured(args.data, args.limit_rows)
    print(report(fit))
    record = {**fit, "rows": rows, "k": k, "seq_len": args.seq_len, "format": fmt,
              "data": list(args.data)}
    if args.check:
        # the same temperatures on rows the fit did not see: does the fit carry over?
        check, rows = measured(args.check, temperatures=fit["temperatures"])
        print(f"the same temperatures on --check's {rows} rows, not fitted on:")
        print(report(check))
        record["check"] = {**check, "rows": rows, "data": list(args.check)}
    file = os.path.join(args.model, "mask_adapter.json")
    config = read_json(file, "mask adapter config")
    config[CALIBRATION] = record
    write_json(file, config)
    print(f"wrote the temperatures into {file} (decoding uses them; --no-calibration: not)")


def report(fit: dict) -> str:
    """The fit as a table: one line per mask slot, then all slots pooled."""
    lines = ["slot  predictions  accuracy  confidence  ->  calibrated  temperature  "
             "ECE  ->  calibrated"]
    for j, T in enumerate(fit["temperatures"]):
        lines.append(f"{j + 1:4d}  {fit['predictions'][j]:11,d}  {fit['accuracy'][j]:8.3f}  "
                     f"{fit['confidence_before'][j]:10.3f}      {fit['confidence_after'][j]:10.3f}"
                     f"  {T:11.3f}  {fit['ece_before_per_slot'][j]:.3f}      "
                     f"{fit['ece_after_per_slot'][j]:.3f}")
    lines.append(f"all slots (their mean, weighted by predictions): ECE {fit['ece_before']:.3f} "
                 f"-> {fit['ece_after']:.3f}")
    return "\n".join(lines)
