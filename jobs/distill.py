"""DistillSpec end to end: measure alpha/tau, distill the draft toward the target, measure again.

By default the distillation runs as the asynchronous Ray pipeline (rollout actors, an object-store buffer,
a Ray Train learner, a weight store, an evaluation actor; metrics on the Ray dashboard). It starts a
local Ray cluster, or joins the one named by ``ray.address`` / ``$RAY_ADDRESS``:

    python jobs/distill.py                                   # offline default: builds the arith garden
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/distill.py --output-dir $PWD/outputs/ray
    python jobs/distill.py ray.mode=sync                     # the single-process loop, no Ray
    python jobs/distill.py --target smollm2-135m-instruct --draft first:2   # a real LLM (setup.sh dev,real)
    python jobs/distill.py --target model.gguf --draft spread:4 distill.train=layers
    python jobs/distill.py --dataset ../shared/data/gsm8k    # garden trained on GSM8K
    python jobs/distill.py --target ORG/big --draft ORG/small --dataset gsm8k
    python jobs/distill.py --config my.yaml distill.steps=500 distill.recipe=supkd

Writes ``results.json`` (one record per phase x gamma x temperature, and the pipeline's ledger and
evaluations), ``tau.png``, ``training.png``, ``config.yaml``, ``train_log.json`` and the distilled draft
(``draft/``, loadable by transformers and as vLLM's draft model) into ``--output-dir``; the learner's Ray Train
checkpoints go to ``--output-dir``/learner, and a rerun with the same ``--output-dir`` resumes from them. The garden,
dequantized GGUF files and layer drafts are cached in ``~/.cache/distillspec`` (``$DISTILLSPEC_CACHE``).
"""

from __future__ import annotations

from distillspec.cli import parse_job_args, run_main
from distillspec.config import JobConfig


def main(cfg: JobConfig) -> list[dict]:
    """Run the job on a validated config; returns the measurement records."""
    from cluster.distill_job import run  # torch and Ray load after parsing: --help stays fast

    return run(cfg)


def cli(argv: list[str] | None = None) -> None:
    """``python jobs/distill.py`` / ``distillspec-distill``: a user's mistake is one line and exit status 2."""
    run_main(lambda: main(parse_job_args(__doc__, argv)))


if __name__ == "__main__":
    cli()
