"""Train a tiny reward model offline for the quickstart task ("repeat the symbol K times"), by
Bradley-Terry on synthetic preference pairs, and save it as a Hugging Face sequence-classifier
directory that `reward.reward_model.model_path` reads.

Pairs: for a task prompt, two candidate answers (the symbol repeated a random number of times, some
with stray characters, some cut off unfinished at the policy's response budget, without an eos);
the one with the higher rule score (`ballast.data.rewards.repeat_score`) is preferred, ties dropped.
Without the unfinished answers the policy finds what the model never saw: answers that run to the
budget without an eos scored high while their rule score stayed near 0 (docs/reward_models.md). The model (the policy's architecture and tokenizer, a fresh score head)
reads the conversation as the trainer hands it over: the chat-templated prompt, the answer, the eos.
Loss: -log sigmoid(r_preferred - r_other). Pairs from the training prompts train it; pairs from the
validation prompts give the held-out pairwise accuracy, printed and written to `<out>/rm_eval.json`.

    python examples/train_reward_model_repeat.py --out .cache/quickstart/rm [--steps 600] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ballast.data.io import read_rows
from ballast.data.rewards import repeat_score
from ballast.models import load_tokenizer
from ballast.models.reward_model import save_reward_model

NOISE = "abcxyz*@ "


def candidate(symbol: str, count: int, rng: random.Random, budget: int):
    """(answer, finished): roughly the requested length, sometimes with other characters mixed in;
    unfinished ones run to `budget` characters (one token each) and get no eos."""
    finished = rng.random() > 0.3
    length = budget if not finished else max(0, int(round(count * rng.choice([rng.uniform(0.0, 2.5),
                                                                                rng.uniform(0.7, 1.3)]))))
    chars = [symbol] * length
    if rng.random() < 0.4:
        for i in range(len(chars)):
            if rng.random() < rng.uniform(0.1, 0.6):
                chars[i] = rng.choice(NOISE)
    return "".join(chars), finished


def make_pairs(rows, per_row: int, rng: random.Random, budget: int):
    """[(prompt messages, preferred answer, other answer)] with distinct rule scores; an answer is
    (text, finished)."""
    pairs = []
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        for _ in range(per_row):
            a, b = (candidate(truth[0], len(truth), rng, budget) for _ in range(2))
            sa, sb = (repeat_score("ballast/repeat", x[0], truth)["score"] for x in (a, b))
            if abs(sa - sb) > 1e-6:
                pairs.append((row["prompt"], a, b) if sa > sb else (row["prompt"], b, a))
    return pairs


def encode(tokenizer, prompt, answer) -> list:
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    text, finished = answer
    return ids + tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if finished else [])


def scores(model, tokenizer, seqs) -> torch.Tensor:
    """The classifier's score of each sequence (right-padded; it pools at the last real token)."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def accuracy(model, tokenizer, pairs, batch: int = 64) -> float:
    model.eval()
    right = 0
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            chunk = pairs[i:i + batch]
            good = scores(model, tokenizer, [encode(tokenizer, p, a) for p, a, _ in chunk])
            bad = scores(model, tokenizer, [encode(tokenizer, p, b) for p, _, b in chunk])
            right += int((good > bad).sum())
    return right / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=".cache/quickstart/model", help="the policy's model directory")
    ap.add_argument("--data", default=".cache/quickstart/data", help="directory with train.parquet and val.parquet")
    ap.add_argument("--out", default=".cache/quickstart/rm")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=64, help="the policy's data.max_response_length")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer(args.model)
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise SystemExit("the tokenizer's pad token is its eos: the classifier would pool before the eos")
    train = make_pairs(read_rows(Path(args.data) / "train.parquet"), 4, rng, args.budget)
    held_out = make_pairs(read_rows(Path(args.data) / "val.parquet"), 16, rng, args.budget)
    model = save_reward_model(args.model, args.out, seed=args.seed)
    model.config.pad_token_id = tokenizer.pad_token_id
    print(f"[rm] {len(train)} training pairs, {len(held_out)} held-out pairs; "
          f"held-out accuracy before training {accuracy(model, tokenizer, held_out):.3f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        model.train()
        chunk = rng.sample(train, args.batch)
        good = scores(model, tokenizer, [encode(tokenizer, p, a) for p, a, _ in chunk])
        bad = scores(model, tokenizer, [encode(tokenizer, p, b) for p, _, b in chunk])
        loss = -F.logsigmoid(good - bad).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps:
            print(f"[rm] step {step} loss {loss.item():.3f} held-out accuracy "
                  f"{accuracy(model, tokenizer, held_out):.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    acc = accuracy(model, tokenizer, held_out)
    model.save_pretrained(args.out)
    info = {"held_out_pairwise_accuracy": acc, "held_out_pairs": len(held_out), "training_pairs": len(train),
            "steps": args.steps, "seed": args.seed, "train_seconds": time.perf_counter() - start}
    (Path(args.out) / "rm_eval.json").write_text(json.dumps(info, indent=1))
    print(f"[rm] saved {args.out}: held-out pairwise accuracy {acc:.3f}", flush=True)


if __name__ == "__main__":
    main()
