"""Recipe search: the recipe grid (data source x divergence x seed) as parallel Ray Tune trials.

The paper finds the best divergence and data source task-dependent (Sec. 5.2, Figure 4), so search them per task:

    python jobs/sweep.py                                          # arith garden, 4 x 4 grid, 40 steps a trial
    python jobs/sweep.py --dataset ../shared/data/gsm8k sweep.steps=60 sweep.seeds=[0,1]
    python jobs/sweep.py sweep.sources=[draft,fixed] sweep.divergences=[tvd,fkl] sweep.trial_cpus=0.5
    python jobs/sweep.py --target ORG/big --draft ORG/small --dataset gsm8k ray.address=auto sweep.trial_gpus=1

Each trial distils the draft for ``sweep.steps`` steps with one recipe (``distillspec.evaluation.study.run_cell``) and
reports alpha, tau and its gain over the undistilled draft at gamma = ``eval.speedup_gamma`` and each of
``eval.temperatures``, the TVD-based alpha and tau, and the distilled draft's own task score. Writes
``sweep.json`` (every trial, the undistilled baseline, the best recipe), ``recipes.png`` (tau gain per cell)
and, with ``sweep.save_drafts``, each distilled draft under ``--output-dir``/drafts/<source>-<divergence>-s<seed>.
"""

from __future__ import annotations

from pathlib import Path

from distillspec.cli import parse_job_args, run_main
from distillspec.config import JobConfig
from distillspec.evaluation.report import format_sweep, plot_recipe_grid
from distillspec.files import exclusive, write_json


def main(cfg: JobConfig) -> dict:
    # Ray, torch and the grid load after parsing: --help stays fast
    from cluster.sweep import run_sweep

    out = Path(cfg.output_dir).resolve()
    with exclusive(out):
        result = run_sweep(cfg, out)
        write_json(out / "sweep.json", result, indent=2)
        plot_recipe_grid(result, out / "recipes.png")
    print(format_sweep(result))
    for f in result["failed"]:
        print(f"trial failed: {f}")
    print(f"\nwrote {out / 'sweep.json'} and {out / 'recipes.png'} ({result['seconds']:.0f}s)")
    return result


def cli(argv: list[str] | None = None) -> None:
    """The console script: a user's mistake is one line and exit status 2."""
    run_main(lambda: main(parse_job_args(__doc__, argv, defaults=("output_dir=outputs/sweep",), job="sweep")))


if __name__ == "__main__":
    cli()
