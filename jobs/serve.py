"""Serve the target with its draft behind an OpenAI-compatible API (speculative decoding on Ray Serve).

    python jobs/serve.py --run outputs/distill             # what that jobs/distill.py run distilled, with its target
    python jobs/serve.py --draft outputs/distill/draft     # the same (a run's draft/ knows its target)
    python jobs/serve.py                                   # the undistilled garden pair, on http://127.0.0.1:8000
    DISTILLSPEC_API_KEY=secret python jobs/serve.py --target T --draft D serve.port=8001 serve.host=0.0.0.0
    python jobs/serve.py serve.record_prompts=true         # online distillation: feed served prompts to a job

Then, e.g. with the ``openai`` client: ``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
.chat.completions.create(model="distillspec", messages=[{"role": "user", "content": "..."}], max_tokens=32)``, or
``.completions.create(model="distillspec", prompt="...", max_tokens=32, extra_body={"gamma": 5})``.

The replicas follow the weight store of the distillation run ``serve.follow.run`` (default ``ray.run_name``):
start ``jobs/distill.py`` on the same Ray cluster and the endpoint serves each new draft version as it is
published. Stop with Ctrl-C.
"""

from __future__ import annotations

from distillspec.cli import parse_job_args, run_main
from distillspec.config import JobConfig


def main(cfg: JobConfig) -> None:
    """Serve until told to stop."""
    from cluster.serve_job import run  # Ray and torch load after parsing: --help stays fast

    run(cfg)


def cli(argv: list[str] | None = None) -> None:
    """The console script: a user's mistake is one line and exit status 2."""
    run_main(lambda: main(parse_job_args(__doc__, argv, ("target", "draft", "dataset", "run"), job="serve")))


if __name__ == "__main__":
    cli()
