"""Where a draft loses acceptance: alpha and greedy agreement by the kind of token the target emits, for several
drafts on the same held-out target samples: exact figures, no speculative decoding.

Each position of the held-out sets (sampled from the target at T = 1 and greedily, exactly, by speculative decoding)
is classed by the token the target emitted there: a ``number`` (its text holds a digit), a ``word`` (a letter, no
digit), or ``space and punctuation`` (neither: line breaks, spaces, operators, signs). For each slice of the test
split (``--sets 0:32 32:64``: questions 0-31 and 32-63), each draft and each kind: its share of the positions, alpha =
1 - E[TVD(p, q)] over them (T = 1), its share of the acceptance lost (the kind's summed TVD over the whole set's), and
the same for greedy agreement on the greedy set. A draft distilled on some questions and not others (an online run
through the endpoint: ``--sets`` the questions it served and others) shows what it learned of each kind where.

    python -m benchmarks.suites.acceptance_by_kind target=qwen2.5-coder-1.5b-instruct \\
        draft=qwen2.5-coder-0.5b-instruct dataset=../shared/data/gsm8k draft_vocab=32768 \\
        --drafts outputs/online-qwen/online/distill/draft --sets 0:32 32:64

``--decoding dtype weight-only fbgemm`` also scores the job's draft as a decoder runs it (in the pair's dtype; with
int8 weights, weight-only as ``draft_int8=auto`` decodes a large draft on an AVX2 CPU, or through fbgemm) on the same
target samples: what a kernel costs in acceptance, without the draws of a race.

Writes ``acceptance_by_kind.json``, ``acceptance_by_kind.md`` and ``acceptance_by_kind.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from benchmarks.suites.draft_temperature import short
from benchmarks.suites.trajectory import held_out, position_acceptance
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.evaluation.report import pyplot
from distillspec.models.draft_vocab import vocab_size
from distillspec.models.loading import INT8_KERNELS, decoding_copy, load_model, load_pair
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task
from distillspec.training.batches import Batch

KINDS = ("number", "word", "space and punctuation")


def token_kinds(tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor) -> torch.Tensor:
    """The index in :data:`KINDS` of each token of ``ids`` (any shape), by its decoded text."""
    unique, inverse = ids.unique(return_inverse=True)
    texts = [tokenizer.decode([token]) for token in unique.tolist()]
    kinds = [0 if any(c.isdigit() for c in t) else 1 if any(c.isalpha() for c in t) else 2 for t in texts]
    return torch.tensor(kinds, dtype=torch.long, device=ids.device)[inverse]


def emitted_kinds(tokenizer: PreTrainedTokenizerBase, batch: Batch) -> torch.Tensor:
    """The kind of the token each position of ``batch.window_mask`` predicts (the next one); -1 where it is 0."""
    following = batch.input_ids[:, batch.window + 1 :]
    following = torch.cat([following, following.new_zeros(following.shape[0], 1)], 1)  # the last column is masked
    return torch.where(batch.window_mask.bool(), token_kinds(tokenizer, following), -1)


def by_kind(scores: torch.Tensor, kinds: torch.Tensor) -> dict[str, dict[str, float]]:
    """For all positions (``all``) and for each kind: the ``positions``, their ``share`` of all, the mean of
    ``scores`` over them (``acceptance``, None where there are none) and their share of what is lost (``lost``: the
    summed ``1 - scores`` over them, over the whole set's)."""
    counted = kinds >= 0
    total, lost = float(counted.sum()), float((1 - scores)[counted].sum())
    out = {}
    for kind, where in (("all", counted), *((kind, kinds == index) for index, kind in enumerate(KINDS))):
        n = float(where.sum())
        out[kind] = {
            "positions": int(n),
            "share": n / max(total, 1.0),
            "acceptance": float(scores[where].sum()) / n if n else None,
            "lost": float((1 - scores)[where].sum()) / lost if lost else 0.0,
        }
    return out


def parse_slice(text: str, questions: int) -> tuple[int, int]:
    """``START:STOP`` of ``--sets``, checked against the test split's ``questions``."""
    try:
        start, stop = (int(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"--sets {text}: each set is START:STOP, e.g. 0:32") from None
    if not 0 <= start < stop <= questions:
        raise SystemExit(
            f"--sets {text}: the task has {questions} test questions; need 0 <= START < STOP <= {questions}"
        )
    return start, stop


#: ``--decoding``: the job's draft as a decoder runs it, in the pair's dtype and with each ``draft_int8`` kernel that
#: scores a whole sequence as it drafts (not ``int4``, whose 4-bit weights take only a step's few rows).
DECODING = {"dtype": False} | {name: value for name, value in INT8_KERNELS.items() if value != "int4"}


def suite_acceptance_by_kind(
    overrides: list[str],
    *,
    drafts: list[str],
    sets: list[str],
    max_new_tokens: int,
    out: Path,
    decoding: Sequence[str] = (),
) -> dict:
    """The whole suite (see the module docstring): the job's draft first (in float32, as it trains), then a copy of
    it per kind of ``decoding`` (:data:`DECODING`), then each of ``drafts``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides)
    task = load_task(cfg.dataset, seed=cfg.seed)
    slices = [parse_slice(text, len(task.test)) for text in sets]
    cfg, task = prepare_pair(cfg, task)
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype, prepack=cfg.prepack)
    vocab = vocab_size(target)
    models = {cfg.draft: draft}
    for kind in decoding:
        label = str(target.dtype).removeprefix("torch.") if kind == "dtype" else f"int8 {kind}"
        models[f"{cfg.draft} [{label}]"] = decoding_copy(draft, target.dtype, DECODING[kind])
    models.update({name: load_model(name, device=cfg.device)[0] for name in drafts})
    result: dict = {"config": {"target": cfg.target, "max_new_tokens": max_new_tokens}, "sets": {}}
    for start, stop in slices:
        began = time.perf_counter()
        samples = held_out(
            target, draft, tokenizer, task.test[start:stop], max_new_tokens=max_new_tokens, seed=cfg.seed
        )
        print(f"questions {start}-{stop - 1}: the target's samples in {time.perf_counter() - began:.0f} s")
        kinds = {t: emitted_kinds(tokenizer, batch) for t, (batch, _) in samples.items()}
        scored = result["sets"][f"{start}:{stop}"] = {}
        for name, model in models.items():
            scores = position_acceptance(model, samples, vocab)
            row = scored[name] = {
                "alpha": by_kind(scores[1.0][1.0], kinds[1.0]),
                "greedy": by_kind(scores[0.0][1.0], kinds[0.0]),
            }
            alpha, greedy = row["alpha"]["all"]["acceptance"], row["greedy"]["all"]["acceptance"]
            print(f"  {name}: alpha {alpha:.4f}, greedy {greedy:.4f}")
            (out / "acceptance_by_kind.json").write_text(json.dumps(result, indent=1))
    (out / "acceptance_by_kind.md").write_text(format_table(result) + "\n")
    plot(result, out / "acceptance_by_kind.png")
    print(format_table(result))
    return result


def mean(part: dict) -> str:
    """A kind's acceptance in a table cell (a dash where the set has none of the kind)."""
    return "-" if part["acceptance"] is None else f"{part['acceptance']:.4f}"


def format_table(result: dict) -> str:
    lines = [
        "alpha (T = 1, 1 - TVD) and greedy agreement (T = 0) by the kind of token the target emits; share: of the "
        "positions; lost: of the acceptance the draft loses on the set",
        "",
        "| questions | draft | kind | share (T = 1) | alpha | lost | share (T = 0) | greedy | lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for questions, drafts in result["sets"].items():
        for name, row in drafts.items():
            for kind in ("all", *KINDS):
                a, g = row["alpha"][kind], row["greedy"][kind]
                cells = [f"{part['share']:.3f} | {mean(part)} | {part['lost']:.3f}" for part in (a, g)]
                lines.append(f"| {questions} | {short(name, 40)} | {kind} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    sets = list(result["sets"].items())
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False, sharey=True)
    lowest = 1.0
    for ax, (questions, drafts) in zip(axes[0], sets):
        width = 0.8 / len(drafts)
        for index, (name, row) in enumerate(drafts.items()):
            values = [row["alpha"][kind]["acceptance"] for kind in KINDS]
            lowest = min([lowest, *(v for v in values if v is not None)])
            ax.bar(
                [k + index * width for k in range(len(KINDS))], [v or 0.0 for v in values], width, label=short(name, 40)
            )
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(KINDS))], KINDS, fontsize=8)
        ax.set(title=f"test questions {questions}", ylabel="alpha at T = 1 (1 - TVD)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylim(max(0.0, lowest - 0.05), 1.0)
    handles, labels = axes[0][0].get_legend_handles_labels()  # below the plots: a draft's name is long
    fig.legend(handles, labels, loc="lower center", fontsize=8, ncol=2)
    fig.tight_layout(rect=(0, 0.05 * ((len(labels) + 1) // 2) + 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_vocab)"
    )
    parser.add_argument("--drafts", nargs="*", default=[], help="more drafts to score (folders, e.g. a run's drafts)")
    parser.add_argument(
        "--sets", nargs="+", default=["0:32"], help="slices of the test split, each scored apart: START:STOP"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="target-sampled tokens per question")
    parser.add_argument(
        "--decoding",
        nargs="*",
        default=[],
        choices=list(DECODING),
        help="also the job's draft as a decoder runs it: in the pair's dtype, with weight-only int8 "
        "(draft_int8=true), through fbgemm (draft_int8=fbgemm)",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/acceptance-by-kind"))
    args = parser.parse_args()
    suite_acceptance_by_kind(
        args.overrides,
        drafts=args.drafts,
        sets=args.sets,
        max_new_tokens=args.max_new_tokens,
        out=args.out,
        decoding=args.decoding,
    )


if __name__ == "__main__":
    run_main(main)
