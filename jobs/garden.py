"""Build the model garden for a task: a tokenizer and a target/draft pair trained from scratch.

    python jobs/garden.py                                        # the embedded arith task
    python jobs/garden.py --dataset ../shared/data/multi30k garden.vocab_size=2048
    python jobs/garden.py garden.target.n_layers=12 garden.draft.d_model=128

The draft is trained on the same data as the target (the paper's fine-tuned, undistilled baseline).
Each model is cached under ``garden.cache_dir`` by its settings; the job prints the two folders
(pass them to ``jobs/distill.py --target ... --draft ...``) and the measured cost ratio c.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distillspec.cli import parse_job_args, run_main
from distillspec.config import JobConfig

if TYPE_CHECKING:
    from distillspec.models.garden import Garden


def main(cfg: JobConfig) -> Garden:
    """Build (or find in the cache) the garden of ``cfg.dataset``; print its folders and cost ratio."""
    # torch and transformers load after parsing: --help stays fast
    from distillspec.decoding.metrics import measure_cost_ratio
    from distillspec.models.garden import build_garden
    from distillspec.models.loading import encode_prompts, load_pair
    from distillspec.tasks.data import load_task

    task = load_task(cfg.dataset, seed=cfg.seed)
    garden = build_garden(task, cfg.garden, seed=cfg.seed)
    target, draft, tokenizer = load_pair(str(garden.target), str(garden.draft), device=cfg.device, dtype=cfg.dtype)
    ids, _ = encode_prompts(tokenizer, [task.test[0].prompt])
    cost = measure_cost_ratio(target, draft, ids.to(target.device), gamma=cfg.eval.speedup_gamma)
    print(f"target: {garden.target}\ndraft:  {garden.draft}")
    print(
        f"c = {cost.c:.3f} (per-token call: target {cost.target_ms:.2f} ms, draft {cost.draft_ms:.2f} ms; "
        f"a {cfg.eval.speedup_gamma + 1}-token verify costs {cost.v:.2f} target calls)"
    )
    return garden


def cli(argv: list[str] | None = None) -> None:
    """The console script: a user's mistake is one line and exit status 2."""
    run_main(lambda: main(parse_job_args(__doc__, argv, flags=("dataset",), job="garden")))


if __name__ == "__main__":
    cli()
