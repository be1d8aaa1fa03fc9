"""Build the model garden for a task: a tokenizer and a target/draft pair trained from scratch.

    python jobs/garden.py                                        # the embedded arith task
    python jobs/garden.py --dataset ../shared/data/multi30k garden.vocab_size=2048
    python jobs/garden.py garden.target.n_layers=12 garden.draft.d_model=128

The draft is trained on the same data as the target (the paper's fine-tuned, undistilled baseline).
Each model is cached under ``garden.cache_dir`` by its settings; the job prints the two folders
(pass them to ``jobs/distill.py --target ... --draft ...``) and the measured cost ratio c.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distillspec.cli import parse_job_args, run_main  # noqa: E402
from distillspec.config import JobConfig  # noqa: E402
from distillspec.data import load_task  # noqa: E402
from distillspec.garden import Garden, build_garden  # noqa: E402
from distillspec.metrics import measure_cost_ratio  # noqa: E402
from distillspec.models import encode_prompts, load_pair  # noqa: E402


def main(cfg: JobConfig) -> Garden:
    task = load_task(cfg.dataset, seed=cfg.seed)
    garden = build_garden(task, cfg.garden, seed=cfg.seed)
    target, draft, tokenizer = load_pair(
        str(garden.target), str(garden.draft), device=cfg.device, target_dtype=cfg.target_dtype
    )
    ids, _ = encode_prompts(tokenizer, [task.test[0].prompt])
    cost = measure_cost_ratio(target, draft, ids.to(target.device), gamma=cfg.eval.speedup_gamma)
    print(f"target: {garden.target}\ndraft:  {garden.draft}")
    print(
        f"c = {cost.c:.3f} (per-token call: target {cost.target_ms:.2f} ms, draft {cost.draft_ms:.2f} ms; "
        f"a {cfg.eval.speedup_gamma + 1}-token verify costs {cost.v:.2f} target calls)"
    )
    return garden


if __name__ == "__main__":
    run_main(lambda: main(parse_job_args(__doc__, flags=("dataset",))))
