"""What a learner step costs by what trains (``distill.train``): the draft's forward pass, backward pass and optimizer
step on batches that come scored (the target's top-k log-probabilities, as a scoring actor ships them with
``learner.target_logits=scorer``), so that a step is the learner's own compute and nothing else. Every setting starts
from the same draft and steps on the same batches; the settings take turns, one step each round after a warm-up step,
so that a drift of the machine's speed touches them alike.

    python -m benchmarks.suites.train_cost target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k draft_vocab=32768 distill.batch_size=8 distill.max_new_tokens=48 \\
        --trains top:12 layers lora:16 --rounds 3

Writes ``train_cost.json`` and ``train_cost.md``: the median seconds a step per setting and its ratio to the first,
and the weights each trains.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.models.loading import load_pair
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task
from distillspec.training.divergences import compress_topk
from distillspec.training.learner import Learner
from distillspec.training.losses import forward_logits, train_temperature
from distillspec.training.rollout import generate_batch


def suite_train_cost(overrides: list[str], trains: list[str], rounds: int, topk: int, out: Path) -> dict:
    """The whole suite (see the module docstring)."""
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)
    d = cfg.distill
    generator = torch.Generator().manual_seed(cfg.seed)
    batches = []  # the draft's own samples (the default recipe's data), scored once
    for i in range(rounds + 1):
        examples = task.train[i * d.batch_size : (i + 1) * d.batch_size]
        with torch.no_grad():  # not inference mode: the learner's autograd takes these tensors
            batch = generate_batch("draft", target, draft, tokenizer, examples, max_new_tokens=d.max_new_tokens,
                                   temperature=d.temperature, generator=generator)  # fmt: skip
            scores = compress_topk(forward_logits(target, batch), topk, train_temperature(d.temperature))
        batches.append((batch, scores))
    del target
    learners = {train: Learner(copy.deepcopy(draft), None, dataclasses.replace(d, train=train)) for train in trains}
    seconds: dict[str, list[float]] = {train: [] for train in trains}
    for i, (batch, scores) in enumerate(batches):
        for train, learner in learners.items():
            record = learner.step(batch, target_logits=scores)
            if i > 0:  # the first round warms up
                seconds[train].append(record["compute_s"])
            print(f"  round {i}/{rounds} {train}: {record['compute_s']:.1f} s, loss {record['loss']:.4f}")
    first = statistics.median(seconds[trains[0]])
    result = {
        "config": dict(
            target=cfg.target,
            draft=cfg.draft,
            batch_size=d.batch_size,
            max_new_tokens=d.max_new_tokens,
            bf16=d.bf16,
            topk=topk,
            rounds=rounds,
            threads=torch.get_num_threads(),
        ),
        "settings": {
            train: {
                "step_s": statistics.median(seconds[train]),
                "ratio": statistics.median(seconds[train]) / first,
                "seconds": seconds[train],
                "trained": sum(p.numel() for group in learner.optimizer.param_groups for p in group["params"]),
            }
            for train, learner in learners.items()
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_cost.json").write_text(json.dumps(result, indent=1))
    (out / "train_cost.md").write_text(format_table(result) + "\n")
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"a learner step on {c['batch_size']} x {c['max_new_tokens']} tokens of the draft's samples, scored as top "
        f"{c['topk']}: median of {c['rounds']} rounds after a warm-up, {c['threads']} threads",
        "",
        "| distill.train | weights the optimizer holds | step, s | ratio |",
        "|---|---|---|---|",
    ]
    for train, row in result["settings"].items():
        lines.append(f"| {train} | {row['trained'] / 1e6:.1f}M | {row['step_s']:.2f} | {row['ratio']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., distill.*)")
    parser.add_argument("--trains", nargs="+", default=["top:12", "layers", "lora:16"], help="distill.train values")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per setting (after one warm-up step)")
    parser.add_argument("--topk", type=int, default=64, help="the target's top k a batch carries (scorer.topk)")
    parser.add_argument("--out", type=Path, default=Path("outputs/train-cost"))
    args = parser.parse_args()
    suite_train_cost(args.overrides, args.trains, args.rounds, args.topk, args.out)


if __name__ == "__main__":
    run_main(main)
