"""Peer tools on the same models, data and machine.

- ``assisted``: our speculative decoding vs transformers' assisted generation (``generate(assistant_model=...)``)
  at the same gamma, batch 1 (T = 0 and T = 1), and our batch 8, which assisted generation does not do.
- ``trl``: our on-policy distillation (Algorithm A.2, recipe ``gkd``: draft-generated data + JSD[0.5]) vs TRL's
  on-policy ``DistillationTrainer`` (the GKD trainer's successor) with the same data, divergence, batch, learning
  rate and steps: alpha against training wall-clock time.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from benchmarks.suites.analysis import plot_peer_curves, race
from benchmarks.suites.common import Scale, available, best_recipe, task_config, with_garden
from distillspec.config import cell_config
from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
from distillspec.evaluation.study import measure_pair
from distillspec.models.loading import encode_prompts, load_pair
from distillspec.training.learner import Distiller


def _load(cfg):
    return load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)


@torch.inference_mode()
def _timed(fn, prompts: list[str], tokenizer, batch: int) -> tuple[float, list[list[int]]]:
    """Tokens/s of ``fn(ids, mask) -> (sequences, prompt_width, num_new)`` over ``prompts`` in batches."""
    seconds, tokens, outputs = 0.0, 0, []
    for i in range(0, len(prompts), batch):
        ids, mask = encode_prompts(tokenizer, prompts[i : i + batch])
        start = time.perf_counter()
        sequences, num_new = fn(ids, mask)
        seconds += time.perf_counter() - start
        tokens += int(num_new.sum())
        width = ids.shape[1]
        outputs += [seq[width : width + int(n)].tolist() for seq, n in zip(sequences, num_new)]
    return tokens / seconds, outputs


def decoder(kind: str, target, draft, tok, *, gamma: int, max_new_tokens: int, temperature: float, seed: int = 0):
    """``fn(ids, mask) -> (sequences, num_new)`` for ``kind``: hf, hf_assisted (transformers), ours, ours_sd,
    ours_sd_compiled (both models' decoding steps through ``torch.compile``)."""
    eos, pad = tok.eos_token_id, tok.pad_token_id

    def hf(ids, mask):
        kw = {"do_sample": temperature > 0, "max_new_tokens": max_new_tokens, "pad_token_id": pad, "eos_token_id": eos}
        if temperature > 0:
            kw |= {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        if kind == "hf_assisted":
            kw["assistant_model"] = draft
        seq = target.generate(ids, attention_mask=mask, **kw)
        gen = seq[:, ids.shape[1] :]
        ended = (gen == eos).long()
        num = torch.where(ended.any(-1), ended.argmax(-1) + 1, torch.full_like(ended[:, 0], gen.shape[1]))
        return seq, num

    def ours(ids, mask):
        kw = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "attention_mask": mask,
            "generator": torch.Generator().manual_seed(seed),
        }
        if kind.startswith("ours_sd"):
            o = speculative_generate(target, draft, ids, gamma=gamma, compile=kind == "ours_sd_compiled", **kw)
        else:
            o = autoregressive_generate(target, ids, **kw)
        return o.sequences, o.num_new_tokens

    return hf if kind.startswith("hf") else ours


ASSISTED_ROUNDS = 3
_ASSISTED_ROWS = (  # label (hf_sample becomes hf_greedy at T = 0), decoder kind, batch
    ("hf_sample", "hf", 1),
    ("hf_assisted", "hf_assisted", 1),
    ("ours_target_only", "ours", 1),
    ("ours_sd", "ours_sd", 1),
    ("ours_sd_compiled", "ours_sd_compiled", 1),
    ("ours_sd_batch8", "ours_sd", 8),
)


def suite_assisted(scale: Scale, overrides: list[str], out: Path) -> dict:
    """Tokens/s: ours vs transformers' assisted generation, batch 1, same gamma; and our batch 8."""
    results = {}
    for name in available(scale.tasks):
        cfg, task = with_garden(task_config(name, scale, overrides, out / name))
        target, draft, tok = _load(cfg)
        gamma, new = cfg.eval.speedup_gamma, cfg.eval.max_new_tokens
        prompts = [e.prompt for e in task.test[: max(8, cfg.eval.speedup_prompts * 2)]]
        draft.generation_config.num_assistant_tokens = gamma
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0  # a fixed gamma, as ours

        rows = {}
        for temperature in (0.0, 1.0):
            t = f"T{temperature:g}"
            print(f"== assisted: {name}, {t}, {len(prompts)} prompts at batch 1, gamma {gamma}")
            opts = {"gamma": gamma, "max_new_tokens": new, "temperature": temperature, "seed": cfg.seed}
            _timed(decoder("hf", target, draft, tok, **opts), prompts[:2], tok, 1)
            # The compiled decoder compiles each shape once (a capacity per prompt-length bucket): one untimed pass
            # over the prompts compiles them all; its time is reported.
            start = time.perf_counter()
            _timed(decoder("ours_sd_compiled", target, draft, tok, **opts), prompts, tok, 1)
            compile_s = time.perf_counter() - start
            # Interleaved rounds, median tokens/s: this machine's speed drifts by +-20% from minute to minute.
            runs, outputs = {}, {}
            for _ in range(ASSISTED_ROUNDS):
                for row, kind, batch in _ASSISTED_ROWS:
                    label = "hf_greedy" if row == "hf_sample" and temperature == 0 else row
                    fn = decoder(kind, target, draft, tok, **opts)
                    speed, outputs[label] = _timed(fn, prompts, tok, batch)
                    runs.setdefault(label, []).append(speed)
            rows[t] = {
                label: {"tokens_per_s": statistics.median(v), "runs": v, "outputs": outputs[label]}
                for label, v in runs.items()
            }
            r = rows[t]
            base = next(k for k in r if k.startswith("hf_") and k != "hf_assisted")
            r["ratio_ours_sd_over_hf_assisted"] = r["ours_sd"]["tokens_per_s"] / r["hf_assisted"]["tokens_per_s"]
            r["ratio_ours_sd_compiled_over_hf_assisted"] = (
                r["ours_sd_compiled"]["tokens_per_s"] / r["hf_assisted"]["tokens_per_s"]
            )
            r["compile_and_first_pass_s"] = compile_s
            r["ratio_hf_assisted_over_hf"] = r["hf_assisted"]["tokens_per_s"] / r[base]["tokens_per_s"]
            r["ratio_ours_sd_over_hf"] = r["ours_sd"]["tokens_per_s"] / r[base]["tokens_per_s"]
            if temperature == 0:  # lossless greedy decoding: all three must print the target's greedy text
                decoded = [r[k]["outputs"] for k in ("hf_greedy", "hf_assisted", "ours_sd", "ours_sd_compiled")]
                same = [len({tuple(o) for o in row}) == 1 for row in zip(*decoded)]
                r["greedy_outputs_agree"] = sum(same) / len(same)
            for k in list(r):
                if isinstance(r[k], dict):
                    r[k].pop("outputs")
            print("  " + ", ".join(f"{k} {v['tokens_per_s']:.1f} tok/s" for k, v in r.items() if isinstance(v, dict)))
            print(
                f"  ours SD / HF assisted: {r['ratio_ours_sd_over_hf_assisted']:.2f}x; compiled "
                f"{r['ratio_ours_sd_compiled_over_hf_assisted']:.2f}x (compiling and a first pass: {compile_s:.0f} s)"
            )
        results[name] = {"gamma": gamma, "max_new_tokens": new, "prompts": len(prompts), **rows}
    return {"tasks": results}


def _alpha(target, draft, tok, task, cfg) -> float:
    draft.eval()
    (r,) = measure_pair(
        target,
        draft,
        tok,
        task,
        gammas=[cfg.eval.speedup_gamma],
        temperatures=[1.0],
        num_prompts=cfg.eval.num_prompts,
        max_new_tokens=cfg.eval.max_new_tokens,
        seed=cfg.seed,
    )
    return r["alpha"]


class _Clock:
    """Training seconds, with the evaluations' time left out."""

    def __init__(self) -> None:
        self.start, self.paused = time.perf_counter(), 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def measure(self, fn):
        t0 = time.perf_counter()
        value = fn()
        self.paused += time.perf_counter() - t0
        return value


def _ours_curve(target, draft, tok, task, cfg, dcfg, steps: int, every: int, start_alpha: float) -> list[dict]:
    """Our synchronous loop (Algorithm A.2) on a copy of ``draft``: alpha every ``every`` steps against seconds."""
    model = copy.deepcopy(draft)
    distiller = Distiller(target, model, tok, task.train, replace_steps(dcfg, steps), seed=cfg.seed)
    clock, curve = _Clock(), [{"step": 0, "seconds": 0.0, "alpha": start_alpha}]
    while distiller.step_count < steps:
        distiller.step()
        if distiller.step_count % every == 0:
            now = clock.now()
            alpha = clock.measure(functools.partial(_alpha, target, model, tok, task, cfg))
            curve.append({"step": distiller.step_count, "seconds": now, "alpha": alpha})
    return curve


#: The best (data source, divergence) per task in the full recipe grid (Figure 4 on docs/RESULTS.md, T = 1).
BEST_RECIPES = {
    "arith": ("fixed", "tvd"),
    "gsm8k": ("target", "jsd"),
    "multi30k": ("target", "tvd"),
    "tinyshakespeare": ("target", "tvd"),
}


def _trl_curve(target, draft, tok, task, cfg, out: Path, steps: int, every: int, start_alpha: float) -> list[dict]:
    """alpha against training time of TRL's ``DistillationTrainer`` on a copy of ``draft``, with our settings."""
    from trl import DistillationConfig, DistillationTrainer

    d = cfg.distill
    student = copy.deepcopy(draft)
    clock, curve = _Clock(), [{"step": 0, "seconds": 0.0, "alpha": start_alpha}]
    args = DistillationConfig(
        output_dir=str(out),
        per_device_train_batch_size=d.batch_size,
        max_steps=steps,
        learning_rate=d.lr,
        lr_scheduler_type="cosine",
        warmup_steps=min(d.warmup_steps, steps),
        beta=d.beta,
        temperature=d.temperature,
        max_completion_length=d.max_new_tokens,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=cfg.device == "cpu",
        disable_dropout=True,
        save_strategy="no",
        report_to=[],
        logging_steps=every,
        disable_tqdm=True,
        seed=cfg.seed,
    )
    # Our prompts start with BOS (encode_prompts); TRL tokenizes the text as given, so give it the BOS too (once).
    bos = tok.bos_token or ""
    prompts = [p if p.startswith(bos) else bos + p for p in (e.prompt for e in task.train[: steps * d.batch_size * 2])]
    trainer = DistillationTrainer(
        model=student,
        teacher_model=target,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        callbacks=[probe(clock, curve, every, functools.partial(_alpha, target, student, tok, task, cfg), student)],
    )
    trainer.train()
    return curve


def suite_trl(scale: Scale, overrides: list[str], out: Path) -> dict:
    """alpha vs training time: ours (sync loop, recipe gkd) vs TRL's DistillationTrainer, same settings."""
    results = {}
    for name in available(scale.tasks[:1]):
        cfg, task = with_garden(
            task_config(name, scale, ["distill.recipe=gkd", "distill.batch_size=16", *overrides], out / name)
        )
        target, draft, tok = _load(cfg)
        steps, every = scale.peer_steps, max(1, scale.peer_steps // 8)
        d = cfg.distill
        start_alpha = _alpha(target, draft, tok, task, cfg)
        curves = {}

        print(f"== trl: {name}, ours ({steps} steps, batch {d.batch_size}, JSD beta {d.beta})")
        curves["ours"] = _ours_curve(target, draft, tok, task, cfg, d, steps, every, start_alpha)
        source, div = BEST_RECIPES[name] if name in BEST_RECIPES else best_recipe(out.parent, name)
        print(f"== trl: {name}, ours with the task's best recipe ({source} data, {div})")
        best_cfg = cell_config(d, source, div, steps)
        curves["ours_best"] = _ours_curve(target, draft, tok, task, cfg, best_cfg, steps, every, start_alpha)

        print(f"== trl: {name}, TRL DistillationTrainer ({steps} steps)")
        curves["trl"] = _trl_curve(target, draft, tok, task, cfg, out / name / "trl", steps, every, start_alpha)

        reached = race(curves["ours"], curves["trl"])
        best = race(curves["ours_best"], curves["trl"])
        row = {
            "steps": steps,
            "batch_size": d.batch_size,
            "alpha_start": start_alpha,
            "curves": curves,
            "alpha_final": {k: c[-1]["alpha"] for k, c in curves.items()},
            "train_seconds": {k: c[-1]["seconds"] for k, c in curves.items()},
            "goal_alpha": reached["goal_alpha"],
            "seconds_to_goal": {"ours": reached["seconds_ours"], "trl": reached["seconds_theirs"]},
            "time_ratio_ours_over_trl": reached["ratio"],
            "best_recipe": {"source": source, "divergence": div},
            "best_goal_alpha": best["goal_alpha"],
            "best_seconds_to_goal": {"ours_best": best["seconds_ours"], "trl": best["seconds_theirs"]},
            "time_ratio_best_over_trl": best["ratio"],
        }
        (out / name).mkdir(parents=True, exist_ok=True)
        plot_peer_curves(
            curves,
            out / name / "trl.png",
            title=f"{name}: on-policy JSD distillation, batch "
            f"{d.batch_size}, alpha at gamma={cfg.eval.speedup_gamma}, T=1",
        )
        print(
            f"  alpha final: ours {row['alpha_final']['ours']:.3f} in {row['train_seconds']['ours']:.0f}s, "
            f"TRL {row['alpha_final']['trl']:.3f} in {row['train_seconds']['trl']:.0f}s; time to the common alpha "
            f"{reached['goal_alpha']:.3f}: ratio ours / TRL {reached['ratio']}; best recipe ({source}, {div}): "
            f"alpha {curves['ours_best'][-1]['alpha']:.3f}, time to {best['goal_alpha']:.3f}: ratio {best['ratio']}"
        )
        results[name] = row
    return {"tasks": results}


def probe(clock: _Clock, curve: list[dict], every: int, measure, student):
    """A TRL (transformers) callback that appends ``{step, seconds, alpha}`` to ``curve`` every ``every`` steps."""

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.start, clock.paused = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % every == 0:
                now = clock.now()
                curve.append({"step": state.global_step, "seconds": now, "alpha": clock.measure(measure)})
                student.train()

    return Probe()


def replace_steps(d, steps: int):
    return replace(d, steps=steps, time_budget_s=0.0)
